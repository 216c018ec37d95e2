"""Learn backprop by doing: write the backward pass of a small GPT yourself, tensor by
tensor, and let the engine check every gradient.

    python examples/backprop_by_hand.py                      # the tensors to do, in order
    cp examples/backprop_template.py mine.py                 # your copy: fill it in
    python examples/backprop_by_hand.py --mine mine.py       # check it
    python examples/backprop_by_hand.py --solution           # the reference answers

The model: a two-layer, two-head GPT (pre-norm blocks on a residual stream, learned
positions, a GELU MLP, an untied output layer) on 4 x 8 characters of Python's own
documentation, in float64, with every intermediate tensor named: 52 of them from the
embedding sum to the loss. Your file holds one numpy function per kind of tensor,
`d_<kind>(f, d, p)`, which returns dL/d(that tensor) from the forward values `f`, the
gradients you have already computed `d`, and the parameters `p`; the functions of a
layer run once per layer. They are called in the order backward computes the gradients,
and the report says, per tensor, exact / close / WRONG / WRONG SHAPE / ERROR / missing,
stopping at your first mistake with the math of the rule that computes it
(mt.inspect.compare_grads, which works on any model; docs/BACKPROP_BY_HAND.md).
"""
import importlib.util
import os
import traceback

import _cli
_cli.script(__name__)   # from here on, Ctrl-C exits quietly

# NOTE: numpy and microtensor are imported inside the functions, once the command line
# has been checked: --help and a bad option answer at once

HERE = os.path.dirname(os.path.abspath(__file__))
TEMPLATE = os.path.join(HERE, "backprop_template.py")
SOLUTION = os.path.join(HERE, "backprop_solution.py")
# the model: batch, context, width, heads, layers; the MLP is 4 * C wide
B, T, C, N_HEAD, N_LAYER = 4, 8, 16, 2, 2
EPS = 1e-5

# what each kind of tensor is, in the words of its forward (shown by the table and the
# template); `x` is a layer's input stream, `out` its output stream
KINDS = {
    "tok_emb": "wte[idx]: the token embeddings",
    "pos_emb": "wpe[:T]: the position embeddings (T, C)",
    "x": "the stream into a layer (x0 = tok_emb + pos_emb, the embedding sum)",
    "ln_mean": "mean = x.mean(-1): a layer norm's mean",
    "ln_var": "var = ((x - mean)^2).mean(-1): its (biased) variance",
    "ln_xhat": "xhat = (x - mean) / sqrt(var + eps): the normalised input",
    "ln1_out": "ln1.out = xhat * w + b, the layer norm before attention",
    "q": "q = heads(ln1.out @ Wq): (B, nh, T, hs)",
    "k": "k = heads(ln1.out @ Wk)",
    "v": "v = heads(ln1.out @ Wv)",
    "scores": "scores = q @ k^T * scale",
    "masked": "masked = scores where causal, else -inf: the causal mask",
    "att": "att = softmax(masked, -1)",
    "y": "y = merge_heads(att @ v): (B, T, C), the heads side by side",
    "attn_out": "attn_out = y @ Wo: attention's output projection",
    "mid": "mid = x + attn_out: the first residual add",
    "ln2_out": "ln2.out = xhat * w + b, the layer norm before the MLP",
    "fc": "fc = ln2.out @ W1 + b1",
    "gelu": "gelu = fc * Phi(fc)",
    "mlp_out": "mlp_out = gelu @ W2 + b2",
    "x_last": "the stream out of the last layer (x2 = mid + mlp_out)",
    "lnf_out": "ln_f.out = xhat * w + b, the final layer norm",
    "logits": "logits = ln_f.out @ Wout",
    "logprobs": "logprobs = log_softmax(logits, -1)",
    "loss": "loss = -mean(logprobs[b, t, targets[b, t]])",
}


# -----------------------------------------------------------------------------
# the model and its forward, every intermediate named

def make_problem(seed=0):
    """Parameters (float64 leaves), token ids and targets: 4 x 9 characters of Python's
    documentation (random tokens where CPython was installed without pydoc_data)."""
    import numpy as np
    import microtensor as mt
    rng = np.random.default_rng(seed)
    try:
        from pydoc_data.topics import topics
        text = "".join(topics[k] for k in sorted(topics))
        starts = rng.integers(0, len(text) - T - 1, size=B)
        chunks = [text[s:s + T + 1] for s in starts]
        vocab = sorted(set("".join(chunks)))
        ids = np.array([[vocab.index(ch) for ch in chunk] for chunk in chunks])
    except ImportError:
        vocab = [chr(ord("a") + i) for i in range(20)]
        ids = rng.integers(0, len(vocab), size=(B, T + 1))
    V = len(vocab)

    def param(*shape, scale=None, base=0.0):
        scale = 1 / np.sqrt(shape[0]) if scale is None else scale
        return mt.tensor(base + scale * rng.standard_normal(shape), dtype=mt.float64,
                         requires_grad=True)
    p = {"wte": param(V, C, scale=0.5), "wpe": param(T, C, scale=0.2)}
    for l in range(N_LAYER):
        h = f"h{l}."
        for ln in ("ln1.", "ln2."):
            p[h + ln + "w"] = param(C, scale=0.1, base=1.0)
            p[h + ln + "b"] = param(C, scale=0.1)
        for name in ("Wq", "Wk", "Wv", "Wo"):
            p[h + name] = param(C, C)
        p[h + "W1"], p[h + "b1"] = param(C, 4 * C), param(4 * C, scale=0.1)
        p[h + "W2"], p[h + "b2"] = param(4 * C, C), param(C, scale=0.1)
    p["ln_f.w"], p["ln_f.b"] = param(C, scale=0.1, base=1.0), param(C, scale=0.1)
    p["Wout"] = param(C, V)
    idx, targets = ids[:, :-1], ids[:, 1:]
    return p, idx, targets, "".join(vocab)


def layer_norm(t, p, x, ln):
    """t[ln + 'mean' | 'var' | 'xhat' | 'out'] from the stream t[x]."""
    t[ln + "mean"] = t[x].mean(-1, keepdim=True)
    t[ln + "var"] = ((t[x] - t[ln + "mean"]) ** 2).mean(-1, keepdim=True)
    t[ln + "xhat"] = (t[x] - t[ln + "mean"]) * (t[ln + "var"] + EPS) ** -0.5
    t[ln + "out"] = t[ln + "xhat"] * p[ln + "w"] + p[ln + "b"]


def forward(p, idx, targets):
    """The named tensors of one forward pass, in the order they are made."""
    import numpy as np
    import microtensor as mt
    from microtensor.nn import functional as F
    hs = C // N_HEAD
    causal = mt.from_numpy(np.tril(np.ones((T, T), dtype=bool)))

    def heads(a):      # (B, T, C) -> (B, nh, T, hs)
        return a.view(B, T, N_HEAD, hs).transpose(1, 2)

    t = {}
    t["tok_emb"] = p["wte"][mt.from_numpy(idx)]                       # (B, T, C)
    t["pos_emb"] = p["wpe"][:T]                                       # (T, C)
    t["x0"] = t["tok_emb"] + t["pos_emb"]                             # the embedding sum
    for l in range(N_LAYER):
        h, x = f"h{l}.", f"x{l}"
        layer_norm(t, p, x, h + "ln1.")
        for name in ("q", "k", "v"):
            t[h + name] = heads(t[h + "ln1.out"] @ p[h + "W" + name])  # (B, nh, T, hs)
        t[h + "scores"] = (t[h + "q"] @ t[h + "k"].transpose(-2, -1)) * (1 / np.sqrt(hs))
        t[h + "masked"] = t[h + "scores"].masked_fill(~causal, float("-inf"))
        t[h + "att"] = t[h + "masked"].softmax(-1)                     # (B, nh, T, T)
        t[h + "y"] = (t[h + "att"] @ t[h + "v"]).transpose(1, 2).reshape(B, T, C)
        t[h + "attn_out"] = t[h + "y"] @ p[h + "Wo"]
        t[h + "mid"] = t[x] + t[h + "attn_out"]                       # residual add 1
        layer_norm(t, p, h + "mid", h + "ln2.")
        t[h + "fc"] = t[h + "ln2.out"] @ p[h + "W1"] + p[h + "b1"]    # (B, T, 4C)
        t[h + "gelu"] = F.gelu(t[h + "fc"])
        t[h + "mlp_out"] = t[h + "gelu"] @ p[h + "W2"] + p[h + "b2"]
        t[f"x{l + 1}"] = t[h + "mid"] + t[h + "mlp_out"]              # residual add 2
    layer_norm(t, p, f"x{N_LAYER}", "ln_f.")
    t["logits"] = t["ln_f.out"] @ p["Wout"]                           # (B, T, V)
    t["logprobs"] = F.log_softmax(t["logits"], -1)
    b, s = np.meshgrid(np.arange(B), np.arange(T), indexing="ij")
    picked = t["logprobs"][mt.from_numpy(b), mt.from_numpy(s), mt.from_numpy(targets)]
    t["loss"] = -picked.mean()
    return t, causal.numpy()


# -----------------------------------------------------------------------------
# which function answers for which tensor, and what it sees under which local names

def spec():
    """[(tensor name, function name, {local name: global name})] in forward order."""
    rows = [("tok_emb", "d_tok_emb", {}), ("pos_emb", "d_pos_emb", {})]
    last = f"x{N_LAYER}"

    def ln_rows(prefix, source):
        local = {"in": source, "mean": prefix + "mean", "var": prefix + "var",
                 "xhat": prefix + "xhat", "out": prefix + "out", "w": prefix + "w",
                 "b": prefix + "b"}
        return [(prefix + kind, f"d_ln_{kind}", local) for kind in ("mean", "var", "xhat")]

    for l in range(N_LAYER):
        h, x = f"h{l}.", f"x{l}"
        local = {"x": x, "out": f"x{l + 1}", "ln1.in": x, "ln2.in": h + "mid", "prefix": h}
        rows.append((x, "d_x", local))
        rows += ln_rows(h + "ln1.", x)
        rows.append((h + "ln1.out", "d_ln1_out", local))
        for kind in ("q", "k", "v", "scores", "masked", "att", "y", "attn_out", "mid"):
            rows.append((h + kind, f"d_{kind}", local))
        rows += ln_rows(h + "ln2.", h + "mid")
        rows.append((h + "ln2.out", "d_ln2_out", local))
        for kind in ("fc", "gelu", "mlp_out"):
            rows.append((h + kind, f"d_{kind}", local))
    top = {"ln_f.in": last}
    rows.append((last, "d_x_last", top))
    rows += ln_rows("ln_f.", last)
    rows += [("ln_f.out", "d_lnf_out", top), ("logits", "d_logits", top),
             ("logprobs", "d_logprobs", top), ("loss", "d_loss", top)]
    return rows


FUNCTION_NAMES = sorted({row[1] for row in spec()})


class NotYet(Exception):
    """A function read the gradient of a tensor that has none yet."""

    def __init__(self, name):
        super().__init__(name)
        self.name = name


class Scope:
    """A dict-like view on forward values, gradients or parameters in which a function
    uses local names ('q', 'ln1.xhat', 'in', 'out'): the scope maps them to the global
    ones ('h0.q', ...), and global names work as they are."""

    def __init__(self, values, local, known=None):
        self.values, self.local, self.known = values, local, known

    def resolve(self, key):
        if key in self.local and key != "prefix":
            return self.local[key]
        prefix = self.local.get("prefix")
        if prefix is not None and (prefix + key in self.values
                                   or (self.known is not None and prefix + key in self.known)):
            return prefix + key
        return key

    def __getitem__(self, key):
        name = self.resolve(key)
        if name in self.values:
            return self.values[name]
        if self.known is not None and name in self.known:
            raise NotYet(name)
        raise KeyError(f"no tensor or parameter named {key!r} here")

    def __contains__(self, key):
        return self.resolve(key) in self.values


def check(functions, seed=0, stop=True):
    """Run the functions {function name: callable} in backward order against the
    engine's gradients. Returns (report, tensors)."""
    import numpy as np
    from microtensor import inspect as mti
    p, idx, targets, _ = make_problem(seed)
    tensors, causal = forward(p, idx, targets)
    mti.retain_grads(tensors)
    tensors["loss"].backward()
    f = {name: t.detach().numpy() for name, t in tensors.items()}
    f.update(idx=idx, targets=targets, causal=causal)
    params = {name: t.detach().numpy() for name, t in p.items()}
    params.update(eps=EPS, scale=1 / np.sqrt(C // N_HEAD), n_head=N_HEAD)
    rows = {row[0]: row for row in spec()}
    order = mti.compare.backward_names(tensors)
    grads, manual, notes = {}, {}, {}
    for name in order:
        _, fname, local = rows[name]
        fn = functions.get(fname)
        if fn is None:
            notes[name] = f"no function {fname} in your file"
            continue
        try:
            value = fn(Scope(f, local), Scope(grads, local, known=tensors), Scope(params, local))
        except NotImplementedError:
            notes[name] = f"{fname} is not written yet"
            continue
        except NotYet as e:
            notes[name] = f"{fname} needs dL/d{e.name} first"
            continue
        except Exception as e:       # the learner's bug: a report line, not a traceback
            e.where = where(e, fn)
            manual[name] = e
            continue
        if value is None:            # a forgotten `return`: one ERROR line
            value = ValueError(f"{fname} returned None; it needs to return a float64 numpy "
                               f"array of shape {tuple(tensors[name].shape)}")
        manual[name] = value         # the checker judges the answer as it came back
        try:                         # what the later functions read: a real float array
            array = np.asarray(value)
            if array.dtype.kind in "biuf":
                grads[name] = array if array.dtype.kind == "f" else array.astype(np.float64)
        except Exception:
            pass
    report = mti.compare_grads(tensors, manual, stop=stop)
    for line in report.lines:
        if line.status == "missing" and line.name in notes:
            line.message = notes[line.name]
    return report, tensors


def where(error, fn):
    """'mine.py line 42' for the deepest frame of an exception inside fn's file."""
    path = getattr(getattr(fn, "__code__", None), "co_filename", None)
    frames = [fr for fr in traceback.extract_tb(error.__traceback__) if fr.filename == path]
    if not frames:
        return ""
    return f"{os.path.basename(path)} line {frames[-1].lineno}"


def load_functions(prog, path):
    """The d_* functions of a learner's file; one line and exit 2 for a file that
    cannot be used."""
    if not os.path.exists(path):
        _cli.fail(prog, f"--mine {path}: no such file (start from a copy: cp "
                        f"{os.path.relpath(TEMPLATE)} {path})")
    if os.path.isdir(path):
        _cli.fail(prog, f"--mine {path} is a directory, not a Python file")
    try:
        with open(path, encoding="utf-8") as fh:
            source = fh.read()
        code = compile(source, path, "exec")
    except UnicodeDecodeError:
        _cli.fail(prog, f"--mine {path} is not UTF-8 text")
    except OSError as e:
        _cli.fail(prog, f"cannot read --mine {path}: {e.strerror or e}")
    except SyntaxError as e:
        _cli.fail(prog, f"--mine {path} line {e.lineno}: syntax error: {e.msg}")
    spec_ = importlib.util.spec_from_loader("backprop_mine", loader=None)
    module = importlib.util.module_from_spec(spec_)
    module.__file__ = path
    try:
        exec(code, module.__dict__)
    except Exception as e:
        line = where(e, type("_", (), {"__code__": code})) or path
        _cli.fail(prog, f"--mine {path} failed while loading ({line}): "
                        f"{type(e).__name__}: {e}")
    functions = {name: getattr(module, name) for name in FUNCTION_NAMES
                 if callable(getattr(module, name, None))}
    if not functions:
        _cli.fail(prog, f"--mine {path} defines none of the functions d_loss, d_logprobs, "
                        f"... (start from a copy of {os.path.relpath(TEMPLATE)})")
    return functions


def table(tensors):
    """The tensors in the order to do them, with their shapes and the function that
    answers for each."""
    from microtensor.inspect.compare import backward_names
    rows = {row[0]: row for row in spec()}
    order = backward_names(tensors)
    width = max(len(n) for n in order)
    lines = [f"{'tensor':<{width}}  {'shape':<16}{'your function':<16}what it is"]
    for name in order:
        fname = rows[name][1]
        kind = fname[2:]
        lines.append(f"{name:<{width}}  {str(tuple(tensors[name].shape)):<16}{fname:<16}"
                     f"{KINDS[kind]}")
    return "\n".join(lines)


def main(argv=None):
    parser = _cli.ArgumentParser(
        prog="backprop_by_hand.py",
        description="The backprop exercise: write dL/d(tensor) for each of the 52 named "
                    "tensors of a two-layer, two-head GPT in numpy, and check every one "
                    "against microtensor's backward. Without --mine or --solution, lists "
                    "the tensors in the order to do them. Takes a few seconds.")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--mine", metavar="FILE",
                       help="your answers: a copy of examples/backprop_template.py with "
                            "the functions filled in (default: none, list the tensors)")
    group.add_argument("--solution", action="store_true",
                       help="check the reference answers, examples/backprop_solution.py "
                            "(default: off)")
    parser.add_argument("--keep_going", action="store_true",
                        help="check every tensor instead of stopping the report at the "
                             "first wrong one (default: stop there)")
    parser.add_argument("--seed", type=_cli.seed_int, default=0, metavar="SEED",
                        help="seed of the weights and of the characters picked (>= 0; "
                             "default: 0)")
    args = parser.parse_args(argv)
    if args.mine is None and not args.solution:
        p, idx, targets, vocab = make_problem(args.seed)
        tensors, _ = forward(p, idx, targets)
        print(f"A two-layer, two-head GPT (B={B}, T={T}, C={C}, vocabulary {len(vocab)}); "
              f"the {len(tensors)} tensors whose gradient you write, in the order backward "
              "computes them:\n")
        print(table(tensors))
        print(f"\nStart: cp {os.path.relpath(TEMPLATE)} mine.py, fill in the functions, then "
              f"python {os.path.relpath(__file__)} --mine mine.py")
        return 0
    path = SOLUTION if args.solution else args.mine
    functions = load_functions(parser.prog, path)
    report, _ = check(functions, args.seed, stop=not args.keep_going)
    print(f"checking {os.path.relpath(path)} against the engine (float64):\n")
    print(report)
    return 0 if report.ok else _cli.EXIT_ERROR


if __name__ == "__main__":
    _cli.run(main)
