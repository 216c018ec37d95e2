"""Byte-level BPE, the algorithm alone: GPT-2's byte alphabet and the merge loop.

A byte-level BPE never meets an unknown character: text becomes UTF-8 bytes, each byte is
a token of its own, and merges join neighbouring tokens, lowest rank first (leftmost on a
tie), until no neighbouring pair has a rank. `models/tokenizer.py` reads the files and
cuts text into pre-tokens; this file turns one pre-token's bytes into ids.

Two ways to rank a pair exist, and both are here because real files use both:
- Hugging Face (`merges.txt`, `tokenizer.json`): a list of merges, each a pair of tokens;
  a pair's rank is its line in the list.
- tiktoken (a `.tiktoken` rank file): no merge list, only each token's rank; a pair's
  rank is the rank of the two tokens joined, if that token exists. A piece that is a
  token as a whole becomes that token without merging.
"""
import heapq
import sys

NO_RANK = sys.maxsize    # a pair that never merges
LONG_PIECE = 128         # bytes; above it the merge loop with a heap (see merge_long)


def bytes_to_unicode():
    """GPT-2's table {byte: printable character}: the bytes that print as themselves keep
    their character, the others (control, space, 0x7f-0xa0, 0xad) take chr(256 + k).
    `vocab.json` and `merges.txt` spell every token's bytes with these characters, so
    that a token such as b' the' reads 'Ġthe' (0x20 -> 'Ġ' = chr(256 + 32))."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTE_OF_CHAR = {c: b for b, c in bytes_to_unicode().items()}
CHAR_OF_BYTE = [bytes_to_unicode()[b] for b in range(256)]


def token_bytes(token):
    """The bytes a byte-level token string stands for ('Ġthe' -> b' the'). A string with a
    character outside GPT-2's alphabet (an added token such as '<pad>' spelled plainly
    is inside it, '▁' is not) stands for its own UTF-8 bytes, as Hugging Face's ByteLevel
    decoder reads it."""
    try:
        return bytes([BYTE_OF_CHAR[c] for c in token])
    except KeyError:
        return token.encode("utf-8")


def token_string(data):
    """The inverse of token_bytes for byte-level text: b' the' -> 'Ġthe'."""
    return "".join([CHAR_OF_BYTE[b] for b in data])


def pair_rank_hf(pair_ranks):
    """rank(a, b) for a merge list: {(a_bytes, b_bytes): line} looked up as a pair."""
    get = pair_ranks.get
    return lambda a, b: get((a, b), NO_RANK)


def pair_rank_tiktoken(ranks):
    """rank(a, b) for a rank file: the rank of the token a + b, if there is one."""
    get = ranks.get
    return lambda a, b: get(a + b, NO_RANK)


def merge(piece, rank):
    """Merge one pre-token's bytes: [bytes] parts, the lowest-ranked neighbouring pair
    joined first, the leftmost one on a tie, until no pair has a rank.
    O(n^2) in the piece's length, which is a handful of bytes for words; long pieces
    (a run of 10,000 letters) go to merge_long."""
    if len(piece) > LONG_PIECE:
        return merge_long(piece, rank)
    parts = [piece[i:i + 1] for i in range(len(piece))]
    ranks = [rank(parts[i], parts[i + 1]) for i in range(len(parts) - 1)]
    while ranks:
        best = min(ranks)
        if best == NO_RANK:
            break
        i = ranks.index(best)                 # leftmost of the lowest
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
        del ranks[i]
        # only the two pairs that touch the new part change rank
        if i > 0:
            ranks[i - 1] = rank(parts[i - 1], parts[i])
        if i < len(ranks):
            ranks[i] = rank(parts[i], parts[i + 1])
    return parts


def merge_long(piece, rank):
    """The same merges as merge(), O(n log n): the pairs in a heap ordered by (rank,
    position), the parts in a linked list. An entry whose pair has changed since it was
    pushed is stale; it is recognised by its rank no longer matching and skipped (a pair
    that changed into another pair of the same rank is the same merge, so it may stay)."""
    n = len(piece)
    parts = [piece[i:i + 1] for i in range(n)]   # None once merged into its left neighbour
    nxt = list(range(1, n + 1))                  # n = no right neighbour
    prv = list(range(-1, n - 1))                 # -1 = no left neighbour
    heap = [(r, i) for i in range(n - 1) if (r := rank(parts[i], parts[i + 1])) != NO_RANK]
    heapq.heapify(heap)
    while heap:
        r, i = heapq.heappop(heap)
        j = nxt[i]
        if parts[i] is None or j >= n or rank(parts[i], parts[j]) != r:
            continue                               # stale
        parts[i] = parts[i] + parts[j]
        parts[j] = None
        nxt[i] = nxt[j]
        if nxt[i] < n:
            prv[nxt[i]] = i
            r = rank(parts[i], parts[nxt[i]])
            if r != NO_RANK:
                heapq.heappush(heap, (r, i))
        if prv[i] >= 0:
            r = rank(parts[prv[i]], parts[i])
            if r != NO_RANK:
                heapq.heappush(heap, (r, prv[i]))
    return [p for p in parts if p is not None]
