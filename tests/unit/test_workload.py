"""Workload files and exact-length text generation."""

import random

import pytest

from tools.spec.workload import TextFactory, WorkloadError, load_chat_workload, load_workload, parse_workload

BUCKETS = (16, 32, 64, 128, 256)


@pytest.fixture(scope="module")
def factory():
    return TextFactory()


def test_default_mix_is_mostly_short_with_a_tail_to_256():
    workload = load_workload()
    shares = workload.bucket_shares(BUCKETS)
    assert shares[16] == pytest.approx(0.50)
    assert shares[256] == pytest.approx(0.04)
    assert sum(shares.values()) == pytest.approx(1.0)
    lengths = workload.sample_lengths(5000)
    assert 250 <= max(lengths) <= 256 and min(lengths) >= 4
    assert sum(n <= 16 for n in lengths) / len(lengths) == pytest.approx(0.5, abs=0.03)


def test_shares_split_bands_that_straddle_a_bucket_edge():
    workload = parse_workload({"lengths": [{"min_tokens": 9, "max_tokens": 24, "weight": 1}]})
    assert workload.bucket_shares([16, 32]) == pytest.approx({16: 0.5, 32: 0.5})
    # Rows beyond the largest bucket are truncated into it.
    assert workload.bucket_shares([8, 16]) == pytest.approx({8: 0.0, 16: 1.0})


def test_samples_are_reproducible():
    workload = load_workload()
    assert workload.sample_lengths(50) == workload.sample_lengths(50)
    assert workload.sample_lengths(50, seed=1) != workload.sample_lengths(50, seed=2)


def test_texts_have_exactly_the_requested_token_count(factory):
    rng = random.Random(3)
    for num_tokens in (3, 4, 16, 17, 100, 255, 256, 400):
        assert factory.count(factory.text(num_tokens, rng)) == num_tokens


def test_texts_for_follow_the_mix(factory):
    workload = load_workload()
    texts = factory.texts_for(workload, 200)
    assert [factory.count(t) for t in texts] == workload.sample_lengths(200)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({}, "at least one"),
        ({"lengths": [{"min_tokens": 4, "max_tokens": 8}]}, "needs min_tokens, max_tokens, weight"),
        ({"lengths": [{"min_tokens": 2, "max_tokens": 8, "weight": 1}]}, "3 <= min_tokens"),
        ({"lengths": [{"min_tokens": 9, "max_tokens": 8, "weight": 1}]}, "min_tokens <= max_tokens"),
        ({"lengths": [{"min_tokens": 4, "max_tokens": 8, "weight": 0}]}, "weight must be > 0"),
        ({"lengths": [{"min_tokens": 4, "max_tokens": 8, "weight": 1}], "rows_per_request": 0}, "rows_per_request"),
    ],
)
def test_workload_errors(data, message):
    with pytest.raises(ValueError, match=message):
        parse_workload(data, "w.toml")


def test_text_rejects_impossible_length(factory):
    with pytest.raises(ValueError, match="at least 3 tokens"):
        factory.text(2, random.Random(0))


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"lengths": [{"min_tokens": 4}]}, "w.toml [lengths[0]]: needs min_tokens, max_tokens, weight "
                                           "(missing max_tokens, weight)"),
        ({"lengths": [{"min_tokens": 9, "max_tokens": 8, "weight": 1}]},
         "w.toml [lengths[0]]: needs 3 <= min_tokens <= max_tokens, got 9 and 8"),
        ({"lengths": [{"min_tokens": 4, "max_tokens": 8, "weight": "most"}]},
         "w.toml [lengths[0]]: 'weight' must be a number, got 'most'"),
        ({"lengths": [{"min_tokens": 4.5, "max_tokens": 8, "weight": 1}]},
         "w.toml [lengths[0]]: 'min_tokens' must be a whole number, got 4.5"),
        ({"lengths": "short"}, "w.toml: 'lengths' must be a list, got 'short'"),
        ({"lengths": [{"min_tokens": 4, "max_tokens": 8, "weight": 1}], "seed": "x"},
         "w.toml: 'seed' must be a number, got 'x'"),
    ],
)
def test_workload_errors_name_the_file_the_band_and_the_key(data, message):
    with pytest.raises(WorkloadError) as info:
        parse_workload(data, "w.toml")
    assert str(info.value) == message


def test_every_problem_in_a_workload_is_reported():
    bands = [{"min_tokens": 4, "max_tokens": 8, "weight": 0}, {"min_tokens": 4, "max_tokens": 8, "weight": 1},
             {"min_tokens": 1, "max_tokens": 8, "weight": 1}]
    with pytest.raises(WorkloadError) as info:
        parse_workload({"lengths": bands, "rows_per_request": 0}, "w.toml")
    assert str(info.value).splitlines() == ["w.toml [lengths[0]]: weight must be > 0, got 0",
                                            "w.toml [lengths[2]]: needs 3 <= min_tokens <= max_tokens, got 1 and 8",
                                            "w.toml: 'rows_per_request' must be >= 1, got 0"]


def test_a_missing_or_broken_workload_file_is_named(tmp_path):
    with pytest.raises(WorkloadError, match=f"workload {tmp_path / 'none.toml'}: .*No such file"):
        load_workload(tmp_path / "none.toml")
    broken = tmp_path / "w.toml"
    broken.write_text("lengths = [")
    with pytest.raises(WorkloadError, match=f"workload {broken}: "):
        load_workload(broken)


# --- chat workloads (the LLM) -------------------------------------------------------------------

KIND = "[[kinds]]\nshare = 1\nprompts = ['x']\nmax_tokens = [1, 2]\n"


def chat(tmp_path, text: str):
    path = tmp_path / "w.toml"
    path.write_text(text)
    return load_chat_workload(path)


def chat_error(tmp_path, text: str) -> str:
    with pytest.raises(WorkloadError) as info:
        chat(tmp_path, text)
    return str(info.value).replace(str(tmp_path / "w.toml"), "w.toml")


@pytest.mark.parametrize(("text", "message"), [
    (KIND.replace("share = 1", "share = true"), "w.toml [kinds[0]]: share must be a number > 0, got True"),
    (KIND.replace("['x']", "['x', ' ']"), "w.toml [kinds[0]]: prompts must be a non-empty list of non-empty strings"),
    (KIND.replace("[1, 2]", "[1, 2.5]"),
     "w.toml [kinds[0]]: max_tokens must be [low, high] integers with 1 <= low <= high, got [1, 2.5]"),
    (KIND + "context_words = [0, 4]\n",
     "w.toml [kinds[0]]: context_words must be [low, high] integers with 1 <= low <= high, got [0, 4]"),
    (KIND.replace("max_tokens = [1, 2]\n", ""), "w.toml [kinds[0]]: missing 'max_tokens'"),
    ("corpus = 5\n" + KIND, "w.toml: 'corpus' must be a string, got 5"),
])
def test_chat_workload_errors_name_the_file_the_kind_and_the_key(tmp_path, text, message):
    assert chat_error(tmp_path, text) == message


def test_long_context_kinds_need_a_corpus(tmp_path):
    text = "corpus = 'words.txt'\n" + KIND + "context_words = [3, 4]\n"
    assert chat_error(tmp_path, text) == (
        f"w.toml [kinds[0]]: needs context words but the corpus {tmp_path / 'words.txt'} is missing or empty")
    (tmp_path / "words.txt").write_text("one two three four")
    workload = chat(tmp_path, text)
    assert workload.corpus_words == ("one", "two", "three", "four") and workload.kinds[0].context_words == (3, 4)


def test_chat_kinds_and_workloads_are_named_by_default(tmp_path):
    workload = chat(tmp_path, KIND + KIND.replace("[[kinds]]\n", "[[kinds]]\nname = 'long'\n"))
    assert workload.name == "w" and [kind.name for kind in workload.kinds] == ["kind0", "long"]


def test_a_missing_chat_workload_file_is_named(tmp_path):
    with pytest.raises(WorkloadError, match=f"chat workload {tmp_path / 'none.toml'}: "):
        load_chat_workload(tmp_path / "none.toml")
