"""A tensor in a few numbers, whatever its size: what the explorer's page shows of it.

    summarise(array)  ->  {numel, nonfinite, mean, std, min, max, norm, hist[, values]
                           [, sample_every, sample]}

The statistics are exact at every size, worked out in float64 one block of `BLOCK`
numbers at a time (never a float64 copy of the whole tensor: GPT-2's 38.6M-entry
embedding would need 309 MB for it), and merged with Chan's pairwise formula for the
variance, which, unlike E[x²] - E[x]², loses nothing when the mean is large against the
spread. Two thresholds, by the number of entries (numel), decide what else is shown:

- at most `SMALL` (8): the numbers themselves, in full;
- at most `LARGE` (2^20 = 1,048,576): the histogram counts every entry; above it, the
  histogram is drawn from an even sample of about `SAMPLE` (2^16 = 65,536) entries,
  every k-th entry with k = ceil(numel / SAMPLE) (`sample_every` = k, `sample` = how
  many entries it counts); its range is still the exact min and max. LARGE is the
  main job's largest tensor (its MLP's hidden activation, 64 x 32 x 512), so the small
  models' pages count every entry; at GPT-2's size the logits (B, T, 50257), the
  embedding (50257, 768) and the MLP weights (768, 3072) are sampled.

NaN and Inf are counted apart (`nonfinite`) and left out of the rest.
"""
import math

import numpy as np

from microtensor.core import _core

__all__ = ["summarise", "dense_norm", "diff_norm", "SMALL", "LARGE", "SAMPLE", "BLOCK"]

SMALL = 8            # at most this many numbers: embedded in full
LARGE = 1 << 20      # above this many: the histogram counts an even sample
SAMPLE = 1 << 16     # of about this many entries (every k-th, k = ceil(numel / SAMPLE))
BLOCK = 1 << 16      # numbers converted to float64 at a time (512 KB: stays in cache)


def _finite(x):
    """A float for JSON (which has no NaN or Inf): None when not finite."""
    x = float(x)
    return x if math.isfinite(x) else None


def _squares(x):
    """sum(x * x) of a float64 block. NOTE: np.einsum's own loop, not np.dot: a BLAS dot
    of a vector wakes BLAS's threads, which wait on the engine's (and on any other
    process's) and made the norms of GPT-2's step take seconds."""
    return float(np.einsum("i,i->", x, x))


def _flat(array):
    """The numbers of an array, a SliceGrad or a tensor, flattened without a copy where
    they are contiguous."""
    if isinstance(array, _core.SliceGrad):
        array = array.dense()
    return np.asarray(array).reshape(-1)


def _blocks(flat):
    """float64 copies of consecutive blocks of a flat array, non-finite entries dropped
    (a block's min and max are NaN or infinite exactly when it holds one)."""
    for start in range(0, flat.size, BLOCK):
        part = flat[start:start + BLOCK]
        if part.dtype.kind == "f" and not (math.isfinite(part.min()) and math.isfinite(part.max())):
            part = part[np.isfinite(part)]
        yield part.astype(np.float64)


def summarise(array, bins=24):
    """mean, std, min, max, 2-norm and a histogram of an array (float64 arithmetic);
    NaN and Inf are counted apart and left out of the rest. See the module doc for the
    thresholds."""
    flat = _flat(array)
    out = {"numel": int(flat.size), "nonfinite": 0}
    count = 0
    mean = m2 = 0.0                 # over the blocks so far: mean and sum((x - mean)^2)
    lo, hi = math.inf, -math.inf
    for block in _blocks(flat):
        n = block.size
        if n == 0:
            continue
        # Chan et al.: merge (count, mean, m2) with the block's own
        block_mean = float(block.mean())
        block_m2 = _squares(block - block_mean)
        total = count + n
        delta = block_mean - mean
        mean += delta * n / total
        m2 += block_m2 + delta * delta * count * n / total
        count = total
        lo, hi = min(lo, float(block.min())), max(hi, float(block.max()))
    out["nonfinite"] = int(flat.size - count)
    if count == 0:
        return out
    every = 1 if flat.size <= LARGE else -(-flat.size // SAMPLE)
    sample = flat[::every]
    if out["nonfinite"]:
        sample = sample[np.isfinite(sample)]
    counts = _histogram(sample, lo, hi, bins)
    # sum(x^2) = m2 + count * mean^2: two terms that are never negative, so nothing cancels
    out.update(mean=mean, std=math.sqrt(m2 / count), min=lo, max=hi,
               norm=math.sqrt(m2 + count * mean * mean), hist=[int(c) for c in counts])
    if every > 1:
        out.update(sample_every=int(every), sample=int(sample.size))
    if flat.size <= SMALL:
        out["values"] = [_finite(v) for v in flat.astype(np.float64)]
    return out


def _histogram(sample, lo, hi, bins):
    """Counts of `sample` in `bins` equal bins over [lo, hi] (all in the middle bin when
    lo == hi). numpy's, unless the range is too narrow for finite-sized float64 bins (a
    few ulps of a large number) or too wide for hi - lo (from -1e308 to 1e308): then on
    the values mapped to [0, 1], halved first so that nothing overflows."""
    width = hi - lo
    if hi > lo and math.isfinite(width):
        try:
            return np.histogram(sample, bins=bins, range=(lo, hi))[0]
        except ValueError:                       # "too many bins for data range"
            pass
    counts = np.zeros(bins, dtype=np.int64)
    if not hi > lo:
        counts[bins // 2] = sample.size
        return counts
    unit = (sample.astype(np.float64) / 2 - lo / 2) / (hi / 2 - lo / 2)
    which = np.clip((unit * bins).astype(np.int64), 0, bins - 1)
    return np.bincount(which, minlength=bins)


def dense_norm(g):
    """The 2-norm of an array, a tensor or a SliceGrad the engine passes, in float64 (NaN
    or Inf where the array holds one)."""
    flat = _flat(g)
    total = 0.0
    for start in range(0, flat.size, BLOCK):
        block = flat[start:start + BLOCK].astype(np.float64)
        total += _squares(block)
    return math.sqrt(total)


def diff_norm(a, b):
    """|a - b| in float64, a block at a time (a parameter's update, from its copy)."""
    a, b = _flat(a), _flat(b)
    total = 0.0
    for start in range(0, a.size, BLOCK):
        d = a[start:start + BLOCK].astype(np.float64) - b[start:start + BLOCK]
        total += _squares(d)
    return math.sqrt(total)
