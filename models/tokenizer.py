"""BPETokenizer: GPT-2's byte-level BPE, read from Hugging Face's or tiktoken's files.

    from models import BPETokenizer
    tok = BPETokenizer.from_pretrained("gpt2")     # a folder: tokenizer.json or vocab.json + merges.txt
    ids = tok.encode("Hello world")                         # [15496, 995] with GPT-2's files
    tok.decode(ids)                                         # 'Hello world'
    tok.encode("<|endoftext|>", allowed_special="all")      # [50256]

Encoding is three steps: special tokens are cut out of the text (only those passed in
`allowed_special`), the rest is cut into pre-tokens by a regular expression (GPT-2's
pattern, or the one the file names), and each pre-token's UTF-8 bytes are merged into
tokens (models/bpe.py). A pre-token's ids are cached: English text repeats its words, so
most pre-tokens are a dictionary look-up and the merge loop runs once per distinct word.
"""
import base64
import binascii
import json
import operator
import os

import regex   # the `re` module has no \p{L} (letter) or \p{N} (number) classes

from models import bpe

# GPT-2's pre-tokenizer (Hugging Face's ByteLevel uses the same): contractions, letters
# with one leading space, numbers, other symbols, and runs of white space that leave the
# last space to the word after them
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# tiktoken's cl100k_base (GPT-3.5/4): contractions in any case, numbers of up to 3 digits
CL100K_PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+|"""
                  r""" ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s""")
CACHE_SIZE = 100_000     # pre-tokens whose ids are kept; the cache empties when full


class BPETokenizer:
    """A byte-level BPE tokenizer. Build it from files with `from_pretrained(folder)` or
    `from_tiktoken(path, pattern)`; the constructor takes what those files hold:

    vocab:          {token bytes: id} for the ordinary tokens (every single byte among them)
    merges:         [(a bytes, b bytes)] in rank order (Hugging Face), or None: then a pair's
                    rank is vocab[a + b], the rank of the token it makes (tiktoken)
    pattern:        the pre-tokenizer's regular expression (the `regex` module's syntax)
    special_tokens: {text: id}, e.g. {"<|endoftext|>": 50256}
    whole_piece_first: a pre-token that is a token as a whole becomes that token unmerged
                    (tiktoken does, Hugging Face's `ignore_merges`); default: merges is None
    source:         what errors name as the origin (the loaders pass the file's path)
    """

    def __init__(self, vocab, merges=None, pattern=GPT2_PATTERN, special_tokens=None, *,
                 whole_piece_first=None, source="BPETokenizer"):
        self.source = source
        self._vocab = dict(vocab)
        self.special_tokens = dict(special_tokens or {})
        self._check_ids()
        self._n_merges = None if merges is None else len(merges)
        if merges is None:
            self._rank = bpe.pair_rank_tiktoken(self._vocab)
        else:
            self._rank = bpe.pair_rank_hf(self._pair_ranks(merges))
        self._whole_piece_first = merges is None if whole_piece_first is None \
            else bool(whole_piece_first)
        if not isinstance(pattern, str):
            raise TypeError(f"{source}: pattern must be a str (a regular expression), "
                            f"got {type(pattern).__name__}")
        try:
            self._pattern = regex.compile(pattern)
        except regex.error as e:
            raise ValueError(f"{source}: the pre-tokenizer pattern {pattern!r} does not "
                             f"compile ({e}); it is read with the `regex` module") from None
        self.pattern = pattern
        self._bytes_of_id = {i: t for t, i in self._vocab.items()}
        self._bytes_of_id.update((i, t.encode("utf-8")) for t, i in self.special_tokens.items())
        self.vocab_size = max(self._bytes_of_id, default=-1) + 1
        self._cache = {}
        self._special_regexes = {}

    def _check_ids(self):
        where = self.source
        ids = {}
        for token, i in self._vocab.items():
            if not isinstance(token, bytes) or type(i) is not int or i < 0:
                raise ValueError(f"{where}: the vocabulary maps bytes to ids >= 0; got "
                                 f"{token!r}: {i!r}")
            if i in ids:
                raise ValueError(f"{where}: id {i} is given to two tokens, {ids[i]!r} and "
                                 f"{token!r}")
            ids[i] = token
        for text, i in self.special_tokens.items():
            if not isinstance(text, str) or not text or type(i) is not int or i < 0:
                raise ValueError(f"{where}: special tokens map non-empty text to ids >= 0; "
                                 f"got {text!r}: {i!r}")
            if i in ids:
                raise ValueError(f"{where}: the special token {text!r} has id {i}, which "
                                 f"is already the token {ids[i]!r}")
            ids[i] = text

    def _pair_ranks(self, merges):
        """{(a, b): rank}, each merge checked against the vocabulary."""
        ranks = {}
        for rank, pair in enumerate(merges):
            if len(pair) != 2 or not all(isinstance(p, bytes) for p in pair):
                raise ValueError(f"{self.source}: merge {rank} is {pair!r}; a merge is a "
                                 f"pair of token bytes, (b'a', b'b')")
            a, b = pair
            for part in (a, b, a + b):
                if part not in self._vocab:
                    raise ValueError(
                        f"{self.source}: merge {rank} ({bpe.token_string(a)!r} + "
                        f"{bpe.token_string(b)!r}) needs the token "
                        f"{bpe.token_string(part)!r}, which the vocabulary lacks; the "
                        f"vocabulary and the merges come from different tokenizers")
            ranks.setdefault((a, b), rank)   # a repeated merge keeps its first rank
        return ranks

    def __repr__(self):
        merges = "rank file" if self._n_merges is None else f"{self._n_merges} merges"
        return (f"BPETokenizer(vocab_size={self.vocab_size}, {merges}, "
                f"special_tokens={sorted(self.special_tokens)})")

    # ---- encode -------------------------------------------------------------------------

    def encode(self, text, allowed_special=(), disallowed_special="all"):
        """text -> [id]. As tiktoken: a special token's text becomes its id only when it is
        in `allowed_special` ("all", or a set of them); by default any other special
        token's text in `text` is a ValueError (text from users that spells
        '<|endoftext|>' must not end a document by accident). `disallowed_special=()`
        encodes such text as ordinary text instead."""
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}"
                            + ("; for bytes, decode them first" if isinstance(
                                text, (bytes, bytearray)) else ""))
        allowed = self._special_set(allowed_special, "allowed_special")
        if isinstance(disallowed_special, str) and disallowed_special == "all":
            disallowed = frozenset(self.special_tokens) - allowed
        else:
            disallowed = self._special_set(disallowed_special, "disallowed_special")
        if disallowed:
            found = self._special_regex(disallowed).search(text)
            if found:
                token = found.group()
                raise ValueError(
                    f"the text contains the special token {token!r}, which is not allowed. "
                    f"To encode it as the special token, pass allowed_special={{{token!r}}} "
                    f"(or 'all'); to encode it as ordinary text, pass "
                    f"disallowed_special=() (or a set without it)")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            # lone surrogates have no UTF-8; tiktoken replaces them with U+FFFD
            text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        if not allowed:
            return self._encode_ordinary(text)
        ids, start = [], 0
        for found in self._special_regex(allowed).finditer(text):
            ids += self._encode_ordinary(text[start:found.start()])
            ids.append(self.special_tokens[found.group()])
            start = found.end()
        ids += self._encode_ordinary(text[start:])
        return ids

    def _special_set(self, value, name):
        if isinstance(value, str):
            if value == "all":
                return frozenset(self.special_tokens)
            raise ValueError(f"{name} is 'all' or a set of special tokens, got the str "
                             f"{value!r}; write {{{value!r}}} for a set of one")
        try:
            tokens = frozenset(value)
        except TypeError:
            raise TypeError(f"{name} is 'all' or a set of special tokens, got "
                            f"{type(value).__name__}") from None
        unknown = sorted(t for t in tokens if t not in self.special_tokens)
        if unknown:
            raise ValueError(f"{name}: {unknown} are not special tokens of this tokenizer; "
                             f"its special tokens are {sorted(self.special_tokens)}")
        return tokens

    def _special_regex(self, tokens):
        """One alternation of the tokens, longest first: where two start at the same place
        (say '<|a|>' and '<|a|>b'), the longer one wins, as in Hugging Face's matcher."""
        found = self._special_regexes.get(tokens)
        if found is None:
            ordered = sorted(tokens, key=lambda t: (-len(t), t))
            found = regex.compile("|".join(regex.escape(t) for t in ordered))
            self._special_regexes[tokens] = found
        return found

    def _encode_ordinary(self, text):
        """text without special tokens -> [id]: pre-tokens, each merged once and cached."""
        if self._pattern.groups:
            pieces = self._pieces_with_gaps(text)
        else:
            pieces = self._pattern.findall(text)
            if sum(map(len, pieces)) != len(text):
                pieces = self._pieces_with_gaps(text)
        cache = self._cache
        ids = []
        extend = ids.extend
        for piece in pieces:
            piece_ids = cache.get(piece)
            if piece_ids is None:
                piece_ids = self._encode_piece(piece)
            extend(piece_ids)
        return ids

    def _pieces_with_gaps(self, text):
        """The pattern's matches, and as pieces of their own the stretches of text between
        them, where a pattern leaves some unmatched: every character reaches a token (as
        Hugging Face's Split does; tiktoken drops them)."""
        pieces, start = [], 0
        for found in self._pattern.finditer(text):
            if found.start() > start:
                pieces.append(text[start:found.start()])
            if found.end() > found.start():
                pieces.append(found.group())
            start = found.end()
        if start < len(text):
            pieces.append(text[start:])
        return pieces

    def _encode_piece(self, piece):
        data = piece.encode("utf-8")
        vocab = self._vocab
        whole = vocab.get(data) if self._whole_piece_first else None
        if whole is not None:
            ids = (whole,)
        else:
            try:
                ids = tuple([vocab[part] for part in bpe.merge(data, self._rank)])
            except KeyError as e:
                raise ValueError(f"{self.source}: the vocabulary has no token for the byte "
                                 f"{e.args[0]!r}, so {piece!r} cannot be encoded; a "
                                 f"byte-level vocabulary holds all 256 bytes") from None
        if len(self._cache) >= CACHE_SIZE:
            self._cache.clear()
        self._cache[piece] = ids
        return ids

    # ---- decode -------------------------------------------------------------------------

    def decode_bytes(self, ids):
        """[id] -> the exact bytes they stand for (a token may end inside a character)."""
        ids = _id_list(ids)
        table = self._bytes_of_id
        try:
            return b"".join([table[i] for i in ids])
        except KeyError:
            bad = next(i for i in ids if i not in table)
            raise ValueError(f"id {bad} is not a token of this tokenizer (ids run from 0 to "
                             f"{self.vocab_size - 1}"
                             + (", with gaps)" if len(table) < self.vocab_size else ")")) \
                from None

    def decode(self, ids, errors="replace"):
        """[id] -> str. Bytes that are not UTF-8 (a sequence of ids cut inside a character)
        become U+FFFD, as in tiktoken; decode_bytes gives them exactly."""
        return self.decode_bytes(ids).decode("utf-8", errors)

    # ---- files --------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, folder):
        """Read a Hugging Face tokenizer folder: tokenizer.json where there is one (it names
        its pattern and its special tokens), else vocab.json + merges.txt (GPT-2's pair;
        `added_tokens.json` beside them is read too). A path to a tokenizer.json works."""
        folder = os.fspath(folder)
        if os.path.isfile(folder) and os.path.basename(folder) == "tokenizer.json":
            return _from_tokenizer_json(cls, folder)
        if not os.path.isdir(folder):
            raise ValueError(f"{folder!r} is not a folder; from_pretrained reads a folder that "
                             f"holds tokenizer.json, or vocab.json and merges.txt, as a "
                             f"GPT-2 checkpoint folder does")
        paths = {name: os.path.join(folder, name)
                 for name in ("tokenizer.json", "vocab.json", "merges.txt", "added_tokens.json")}
        if os.path.isfile(paths["tokenizer.json"]):
            return _from_tokenizer_json(cls, paths["tokenizer.json"])
        missing = [name for name in ("vocab.json", "merges.txt") if not os.path.isfile(paths[name])]
        if missing:
            raise ValueError(
                f"{folder}: no tokenizer.json, and no {' and no '.join(missing)}; a tokenizer "
                f"folder holds tokenizer.json or vocab.json + merges.txt (Hugging Face's "
                f"`tokenizer.save_pretrained(folder)` writes them; they come with every "
                f"GPT-2 checkpoint on the Hugging Face Hub)")
        return _from_vocab_and_merges(cls, paths["vocab.json"], paths["merges.txt"],
                                      paths["added_tokens.json"])

    @classmethod
    def from_tiktoken(cls, path, pattern, special_tokens=None):
        """Read a tiktoken rank file (one `base64-token rank` a line, as
        cl100k_base.tiktoken); tiktoken keeps the pattern and special tokens in code, so
        they are given here: from_tiktoken(path, CL100K_PATTERN, {"<|endoftext|>": 100257})."""
        path = os.fspath(path)
        contents = _read(path, "a tiktoken rank file")
        vocab, ranks = {}, {}
        for number, line in enumerate(contents.splitlines(), 1):
            if not line.strip():
                continue
            fields = line.split()
            try:
                if len(fields) != 2:
                    raise ValueError
                token, rank = base64.b64decode(fields[0], validate=True), int(fields[1])
            except (ValueError, binascii.Error):
                shown = line[:80].decode("utf-8", "replace")
                raise ValueError(f"{path}: line {number} is {shown!r}, not a base64 token "
                                 f"and its rank; a tiktoken rank file has one "
                                 f"`base64-token rank` a line") from None
            if token in vocab or rank in ranks or rank < 0:
                raise ValueError(f"{path}: line {number}: "
                                 + (f"the token {token!r} comes twice" if token in vocab else
                                    f"the rank {rank} comes twice" if rank in ranks else
                                    f"the rank {rank} is negative")
                                 + "; the file is damaged: fetch it again")
            vocab[token] = ranks[rank] = rank
        if not vocab:
            raise ValueError(f"{path}: no tokens; a tiktoken rank file has one "
                             f"`base64-token rank` a line")
        return cls(vocab, None, pattern, special_tokens, source=path)


def _read(path, what):
    """The bytes of a file, or a ValueError that says which file is missing."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{path}: cannot read {what} ({e.strerror})") from None


def _read_json(path):
    data = _read(path, "a JSON file")
    try:
        return json.loads(data)
    except ValueError as e:       # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{path}: not valid JSON ({e}); the file may be cut short, or a "
                         f"Git LFS pointer instead of the file: download it again") from None


def _vocab_of(table, path):
    """{token string: id} from vocab.json or tokenizer.json's model.vocab, checked."""
    if not isinstance(table, dict) or not all(
            isinstance(t, str) and type(i) is int and i >= 0 for t, i in table.items()):
        raise ValueError(f"{path}: the vocabulary is not a JSON object of token: id (ids are "
                         f"integers >= 0), as Hugging Face writes it")
    return table


def _merge_pairs(lines, path, label="merge"):
    """[(a, b)] token strings from merges.txt lines or tokenizer.json's model.merges (each
    "a b", or ["a", "b"] since tokenizers 0.20)."""
    pairs = []
    for number, line in lines:
        pair = line.split(" ") if isinstance(line, str) else line
        if (not isinstance(pair, list) or len(pair) != 2
                or not all(isinstance(p, str) and p for p in pair)):
            raise ValueError(f"{path}: {label} {number} is {line!r}; a merge is two tokens, "
                             f"written 'a b' (or [\"a\", \"b\"] in tokenizer.json)")
        pairs.append(tuple(pair))
    return pairs


def _hf_tokenizer(cls, vocab, pairs, special, pattern, path, ignore_merges=False):
    """The tokenizer from Hugging Face's token strings (GPT-2's byte alphabet)."""
    vocab = {t: i for t, i in vocab.items() if special.get(t) != i}
    for text, i in special.items():
        if text in vocab:
            raise ValueError(f"{path}: the special token {text!r} is {i} among the added "
                             f"tokens and {vocab[text]} in the vocabulary")
    by_bytes = {}
    for token, i in vocab.items():
        data = bpe.token_bytes(token)
        if data in by_bytes:
            raise ValueError(f"{path}: the tokens {by_bytes[data][0]!r} and {token!r} stand "
                             f"for the same bytes {data!r}")
        by_bytes[data] = (token, i)
    merges = [(bpe.token_bytes(a), bpe.token_bytes(b)) for a, b in pairs]
    return cls({data: i for data, (_, i) in by_bytes.items()}, merges, pattern, special,
               whole_piece_first=ignore_merges, source=path)


def _from_vocab_and_merges(cls, vocab_path, merges_path, added_path):
    """GPT-2's files. Their special tokens are not marked: a token that is neither one byte
    nor made by a merge can only ever be produced as a special token (GPT-2's
    '<|endoftext|>'), so those are the special tokens, with added_tokens.json's."""
    vocab = _vocab_of(_read_json(vocab_path), vocab_path)
    try:
        text = _read(merges_path, "merges.txt").decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{merges_path}: not UTF-8 text; merges.txt has one merge a line, "
                         f"two tokens and a space: download it again") from None
    # split at "\n" only: str.splitlines would also split at U+0085, U+2028 and others
    lines = [(n, line.rstrip("\r")) for n, line in enumerate(text.split("\n"), 1)
             if line.strip() and not line.startswith("#version")]
    pairs = _merge_pairs(lines, merges_path, "line")
    made = {a + b for a, b in pairs}
    special = {t: i for t, i in vocab.items()
               if t not in made and not (len(t) == 1 and t in bpe.BYTE_OF_CHAR)}
    if os.path.isfile(added_path):
        special.update(_vocab_of(_read_json(added_path), added_path))
    return _hf_tokenizer(cls, vocab, pairs, special, GPT2_PATTERN,
                         f"{vocab_path} + merges.txt")


def _from_tokenizer_json(cls, path):
    """Hugging Face tokenizers' one file: a BPE model with GPT-2's byte-level
    pre-tokenizer, alone or after a Split that names its own pattern."""
    spec = _read_json(path)
    model = spec.get("model") if isinstance(spec, dict) else None
    if not isinstance(model, dict) or model.get("type", "BPE") != "BPE" \
            or "vocab" not in model or "merges" not in model:
        raise ValueError(f"{path}: not a BPE tokenizer (its model is "
                         f"{model.get('type') if isinstance(model, dict) else model!r}); "
                         f"BPETokenizer reads byte-level BPE only")
    for field in ("dropout", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(field):
            raise ValueError(f"{path}: model.{field} = {model[field]!r} is not supported "
                             f"(GPT-2's byte-level BPE has none)")
    if spec.get("normalizer"):
        raise ValueError(f"{path}: the normalizer {spec['normalizer'].get('type')!r} is not "
                         f"supported; a byte-level BPE encodes the text as it is")
    pattern = _pattern_of(spec.get("pre_tokenizer"), path)
    special = {}
    for added in spec.get("added_tokens") or []:
        for flag in ("lstrip", "rstrip", "single_word"):
            if added.get(flag):
                raise ValueError(f"{path}: the added token {added.get('content')!r} has "
                                 f"{flag}=true, which is not supported")
        if not isinstance(added, dict) or "content" not in added or "id" not in added:
            raise ValueError(f"{path}: added_tokens holds {added!r}, not a token with its "
                             f"content and id")
        special[added["content"]] = added["id"]
    vocab = _vocab_of(model["vocab"], path)
    merges = model["merges"]
    if not isinstance(merges, list):
        raise ValueError(f"{path}: model.merges is not a list")
    pairs = _merge_pairs(enumerate(merges), path)
    return _hf_tokenizer(cls, vocab, pairs, special, pattern, path,
                         bool(model.get("ignore_merges")))


def _pattern_of(pre, path):
    """The pre-tokenizer's pattern: GPT-2's for ByteLevel(use_regex=true), a Split's for
    Sequence[Split(pattern, 'Isolated'), ByteLevel(use_regex=false)] (Llama 3, Qwen)."""
    kind = pre.get("type") if isinstance(pre, dict) else None
    steps = pre.get("pretokenizers") if kind == "Sequence" else [pre]
    if not isinstance(steps, list) or not steps:
        steps = [None]
    *splits, byte_level = steps
    if not isinstance(byte_level, dict) or byte_level.get("type") != "ByteLevel" \
            or len(splits) > 1:
        raise ValueError(f"{path}: the pre-tokenizer is {pre!r}; BPETokenizer reads "
                         f"GPT-2's byte-level one (ByteLevel, or a Split then ByteLevel)")
    if byte_level.get("add_prefix_space"):
        raise ValueError(f"{path}: ByteLevel's add_prefix_space=true is not supported: "
                         f"decode(encode(text)) would gain a space")
    if not splits:
        if not byte_level.get("use_regex", True):
            raise ValueError(f"{path}: ByteLevel with use_regex=false and no Split: no "
                             f"pattern to cut the text into words")
        return GPT2_PATTERN
    split = splits[0] if isinstance(splits[0], dict) else {}
    pattern = split.get("pattern")
    if split.get("type") != "Split" or split.get("behavior") != "Isolated" \
            or split.get("invert") or not isinstance(pattern, dict) \
            or byte_level.get("use_regex", True):
        raise ValueError(f"{path}: the pre-tokenizer {pre!r} is not supported; BPETokenizer "
                         f"reads Split(pattern, behavior='Isolated') then "
                         f"ByteLevel(use_regex=false)")
    if "Regex" in pattern:
        return pattern["Regex"]
    return regex.escape(pattern["String"])


def _id_list(ids):
    """A flat list of Python ints from a list, tuple, range, numpy array or Tensor."""
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if isinstance(ids, int):
        raise TypeError("decode takes a sequence of ids; for one id write [id]")
    if isinstance(ids, (str, bytes, bytearray)):
        raise TypeError(f"decode takes a sequence of int ids, got {type(ids).__name__}")
    try:
        ids = list(ids)
    except TypeError:
        raise TypeError(f"decode takes a sequence of int ids, got {type(ids).__name__}") \
            from None
    if all(type(i) is int for i in ids):
        return ids
    out = []
    for i in ids:
        if isinstance(i, (list, tuple)):
            raise TypeError("decode takes one flat sequence of ids; for a batch, decode each "
                            "row")
        try:
            out.append(operator.index(i))      # numpy integers
        except TypeError:
            raise TypeError(f"ids are ints, got {i!r} ({type(i).__name__})") from None
    return out
