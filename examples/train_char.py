"""Train a character-level GPT on a text file with microtensor.

    python examples/train_char.py                     # Python's own docs (run time: --help)
    python examples/train_char.py --data input.txt --n_layer 4 --n_head 4 --n_embd 128
    python examples/train_char.py --resume            # continue out-char/ckpt_last.safetensors
    python examples/sample.py --prompt "The "         # generate from the newest checkpoint
    python examples/train_char.py --init_from gpt2 --data input.txt   # fine-tune GPT-2

Reads top to bottom like nanoGPT's train.py: defaults, data, model, optimizer, then one
loop that evaluates, checkpoints and steps. Ctrl-C stops after the current step and
writes a checkpoint that --resume continues exactly. A loss that turns NaN or Inf stops
the run (exit status 1) before it can overwrite a good checkpoint; one run at a time
owns --out_dir (a lock file), and a directory holding an earlier run is refused unless
--resume or --force says what to do with it.

--init_from PATH fine-tunes a Hugging Face GPT-2 checkpoint instead (a folder with
config.json, model.safetensors and its tokenizer, or a Hub name such as gpt2): the text
is read with that checkpoint's BPE, the model is that checkpoint's, other defaults suit
fine-tuning (FINETUNE_DEFAULTS), and out_dir/hf/ holds the best model in the same format,
which GPT.from_pretrained, sample.py --init_from and transformers load.
"""
import argparse
import contextlib
import json
import math
import os
import signal
import sys
import time

import _cli
_cli.script(__name__)   # from here on, Ctrl-C exits quietly

# wall-clock seconds of the run with no arguments at the default threads, the final sample
# included, as measured by docs/regenerate.py on the CPU docs/TRAINING.md names (it
# rewrites this line and the docs that quote it).
DEFAULT_RUN_SECONDS = 134

# -----------------------------------------------------------------------------
# Defaults. Every one can be overridden: --name value (see --help). They are sized so
# that a run with no arguments trains for about DEFAULT_RUN_SECONDS on a 2-core machine
# and then writes mostly real words.
DEFAULTS = dict(
    # I/O
    out_dir="out-char",      # checkpoints, metrics.csv and loss.png go here
    eval_interval=100,       # evaluate, log and checkpoint every this many iterations
    eval_iters=10,           # batches averaged per split for an evaluation
    resume=False,            # continue from out_dir/ckpt_last.safetensors
    # data
    data=None,               # UTF-8 text file; None = Python's documentation (pydoc_data)
    block_size=32,           # context length in characters: enough to spell words
    batch_size=64,           # sequences per micro-batch
    grad_accum=1,            # micro-batches per optimizer step
    # model (GPTConfig): two wide-ish layers learn spelling faster per second than more
    # narrow ones, and a short context makes every step cheap
    n_layer=2,
    n_head=4,
    n_embd=128,
    dropout=0.0,
    bias=True,
    norm="layernorm",
    pos="learned",
    mlp="gelu",
    prenorm=True,
    tie_weights=True,
    d_ff=None,               # MLP hidden width; None = GPTConfig's rule (4*n_embd, swiglu 8/3)
    # optimizer: AdamW, warmup then cosine decay (nanoGPT's get_lr)
    max_iters=1200,
    lr=5e-3,                 # high, but a small model with warmup and clipping takes it
    min_lr=None,             # None = lr / 10
    warmup_iters=50,
    lr_decay_iters=None,     # None = max_iters
    weight_decay=0.1,        # applied to 2-D weights only (matrices and embeddings)
    beta1=0.9,
    beta2=0.99,
    grad_clip=1.0,           # 0 disables clipping
    # system
    seed=1337,
    # 0: the library's default (the physical cores; kernels too small to gain from a
    # second thread run on one, see docs/TRAINING.md); --threads n sets n
    threads=0,
    sample_chars=500,        # length of the sample printed at the end (0 = none)
    grad_stats=False,        # at each evaluation, the gradient norm at each block's input
    init_from=None,          # a Hugging Face GPT-2 checkpoint to fine-tune; None = a new model
)

# with --init_from, defaults that suit fine-tuning a pretrained model (nanoGPT's
# finetune_shakespeare at a CPU's block size): a small learning rate, short runs
FINETUNE_DEFAULTS = dict(block_size=64, batch_size=8, lr=3e-5, warmup_iters=0,
                         max_iters=200, eval_interval=20, eval_iters=10, sample_chars=100)

# options that fix the shape of the weights: --resume must not change them
MODEL_SHAPE_KEYS = ("block_size", "n_layer", "n_head", "n_embd", "bias", "norm", "pos",
                    "mlp", "prenorm", "tie_weights", "d_ff", "init_from")
# options that --init_from takes from the checkpoint's config.json instead
PRETRAINED_KEYS = ("n_layer", "n_head", "n_embd", "bias", "norm", "pos", "mlp", "prenorm",
                   "tie_weights", "d_ff")
# options that describe this invocation, never taken from a checkpoint
NOT_RESUMED_KEYS = ("out_dir", "resume", "threads", "force")
# what a run writes in out_dir (--force removes an earlier run's copies first)
OUTPUT_NAMES = ("ckpt_last.safetensors", "ckpt_best.safetensors", "metrics.csv", "loss.png",
                "grad_stats.csv")


def build_parser():
    p = _cli.ArgumentParser(
        prog="train_char.py",
        description="Train a character-level GPT with microtensor. The defaults train on "
                    "Python's documentation text in about "
                    f"{_cli.minutes(DEFAULT_RUN_SECONDS)} (measured: {DEFAULT_RUN_SECONDS} s "
                    "of wall clock at the default threads on the 2-core Intel Xeon that "
                    "docs/TRAINING.md names, the final sample included; it varies with the "
                    "CPU). Bad "
                    "options end in one line 'error: ...' and exit status 2; a loss that "
                    "becomes NaN or Inf stops the run with status 1 and keeps the last "
                    "good checkpoint; Ctrl-C saves a checkpoint and exits with status 130.",
        # SUPPRESS: only options given on the command line appear in the result, so
        # --resume can tell an explicit --n_embd (must match the checkpoint) from a default
        argument_default=argparse.SUPPRESS,
    )

    def option(name, help, type=None, group=p, **kw):
        default = DEFAULTS[name]
        shown = "none" if default is None else default
        if "choices" not in kw:  # argparse lists the choices itself
            kw["metavar"] = name.upper()
        group.add_argument(f"--{name}", type=type, help=f"{help} (default: {shown})", **kw)

    def flag(name, help, group):
        group.add_argument(f"--{name}", action=argparse.BooleanOptionalAction,
                           help=f"{help} (default: {DEFAULTS[name]})")

    io = p.add_argument_group("data and output")
    option("data", "UTF-8 text file to train on; none = Python's documentation text "
           "shipped with CPython (pydoc_data.topics)", str, io)
    option("init_from", "fine-tune a Hugging Face GPT-2 checkpoint: a folder with "
           "config.json, model.safetensors and vocab.json + merges.txt, or a Hub name "
           "(gpt2); the text is read with its BPE, the model options are its own, the "
           "defaults become fine-tuning's (" + ", ".join(f"{k}={v}" for k, v in
                                                   FINETUNE_DEFAULTS.items())
           + "), and out_dir/hf/ receives the best model in the same format", str, io)
    option("out_dir", "directory for checkpoints, metrics.csv and loss.png", str, io)
    io.add_argument("--resume", action="store_true",
                    help="continue the run in out_dir from ckpt_last.safetensors; settings "
                         "not given on the command line come from the checkpoint "
                         "(default: start afresh)")
    io.add_argument("--force", action="store_true",
                    help="start afresh in an out_dir that already holds files, replacing an "
                         "earlier run's " + ", ".join(OUTPUT_NAMES) + " (default: refuse "
                         "such a directory unless --resume)")
    option("eval_interval", "evaluate, log and checkpoint every N iterations (>= 1)",
           _cli.positive_int, io)
    option("eval_iters", "batches per split averaged for the train and val loss (>= 1)",
           _cli.positive_int, io)
    option("sample_chars", "characters of text sampled at the end, BPE tokens with "
           "--init_from (0: no sample)",
           _cli.nonnegative_int, io)
    flag("grad_stats", "at every evaluation, one extra forward and backward on a fixed "
         "training batch (weights and training untouched) records the gradient norm "
         "reaching each block's input, in grad_stats.csv and as a heatmap (block by "
         "iteration) beside the loss in loss.png", io)

    model = p.add_argument_group("model (GPTConfig)")
    option("n_layer", "number of transformer blocks (>= 1)", _cli.positive_int, model)
    option("n_head", "attention heads per block (>= 1, divides n_embd)", _cli.positive_int,
           model)
    option("n_embd", "embedding width (a multiple of n_head)", _cli.positive_int, model)
    option("block_size", "context length in characters (>= 1)", _cli.positive_int, model)
    option("dropout", "dropout probability during training, in [0, 1)", _cli.probability,
           model)
    option("norm", "normalisation layer", str, model, choices=["layernorm", "rmsnorm"])
    option("pos", "position information", str, model,
           choices=["learned", "sinusoidal", "rope", "none"])
    option("mlp", "feed-forward type (swiglu has three matrices)", str, model,
           choices=["gelu", "relu", "swiglu"])
    option("d_ff", "hidden width of the feed-forward block (>= 1); none = 4*n_embd, or for "
           "swiglu 8/3*n_embd rounded up to a multiple of 8 (about the same parameter count)",
           _cli.positive_int, model)
    flag("prenorm", "normalise before attention/MLP (pre-norm) instead of after", model)
    flag("bias", "biases in Linear and LayerNorm layers", model)
    flag("tie_weights", "share the token embedding with the output layer", model)

    train = p.add_argument_group("training (AdamW, warmup then cosine decay)")
    option("batch_size", "sequences per micro-batch (>= 1)", _cli.positive_int, train)
    option("grad_accum", "micro-batches accumulated per optimizer step (>= 1)",
           _cli.positive_int, train)
    option("max_iters", "optimizer steps in total (0: evaluate and save the initial model)",
           _cli.nonnegative_int, train)
    option("lr", "peak learning rate (> 0; above 1 a warning, and a run whose loss turns "
           "NaN stops)", _cli.positive_number, train)
    option("min_lr", "final learning rate, in [0, lr]; none = lr/10", _cli.nonnegative_number,
           train)
    option("warmup_iters", "linear warmup steps (>= 0)", _cli.nonnegative_int, train)
    option("lr_decay_iters", "step where the cosine decay reaches min_lr; none = max_iters",
           _cli.nonnegative_int, train)
    option("weight_decay", "AdamW weight decay on 2-D weights (biases and norms get none), "
           ">= 0", _cli.nonnegative_number, train)
    option("beta1", "AdamW beta1, the decay rate of the gradient's running average, in "
           "[0, 1)", _cli.beta, train)
    option("beta2", "AdamW beta2, the decay rate of the squared gradient's running average, "
           "in [0, 1)", _cli.beta, train)
    option("grad_clip", "clip the gradient norm to this value; 0 = no clipping",
           _cli.nonnegative_number, train)

    system = p.add_argument_group("system")
    option("seed", "seed for initialisation, dropout and batch sampling (>= 0)",
           _cli.seed_int, system)
    option("threads", "threads for microtensor's kernels and BLAS; 0 = the library's "
           "default (the physical cores)", _cli.nonnegative_int, system)
    system.add_argument("--compile", action=argparse.BooleanOptionalAction,
                        default=argparse.SUPPRESS,
                        help="run the training step through mt.compile: its ops are recorded "
                             "on the first two steps and replayed after, with the same numbers "
                             "(default: on; off under --ddp)")
    system.add_argument("--ddp", action="store_true",
                        help="data-parallel training over MPI: mpiexec -n N python "
                             "examples/train_char.py --ddp; each rank trains on its own "
                             "batches, rank 0 alone writes (needs pip install "
                             "'microtensor[mpi]'; default: one process)")
    return p


def get_lr(it, run):
    """Linear warmup, cosine decay to min_lr at lr_decay_iters, then constant (nanoGPT)."""
    lr, min_lr, warmup = run["lr"], run["min_lr"], run["warmup_iters"]
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    if it >= run["lr_decay_iters"]:
        return min_lr
    decay_ratio = (it - warmup) / (run["lr_decay_iters"] - warmup)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))  # 1 -> 0
    return min_lr + coeff * (lr - min_lr)


def main(argv=None):
    # what must be undone however the run ends (the lock on out_dir) goes on `cleanup`
    with contextlib.ExitStack() as cleanup:
        return train(argv, cleanup)


def train(argv, cleanup):
    parser = build_parser()
    given = vars(parser.parse_args(argv))
    prog = parser.prog

    def fail(message, status=_cli.EXIT_USAGE):
        _cli.fail(prog, message, status)

    if given.get("force") and given.get("resume"):
        fail("--force starts afresh and --resume continues: give one of them")
    if given.get("grad_stats") and given.get("ddp"):
        fail("--grad_stats records one process's gradients: run it without --ddp")

    # Threads first: OpenBLAS reads these when numpy is imported (a no-op when main()
    # runs inside a process that already imported numpy; set_blas_threads covers that).
    threads = _cli.resolve_threads(prog, given.get("threads", DEFAULTS["threads"]))
    if threads > 0:
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            os.environ[var] = str(threads)

    import numpy as np
    from tqdm import tqdm
    import microtensor as mt
    import chardata
    from chardata import CharDataError

    if threads > 0:
        mt.set_num_threads(threads)
        chardata.set_blas_threads(threads)

    # --- ddp: under `mpiexec -n N ... --ddp` every rank trains on its own batches and
    # evaluates (the same batches and weights everywhere, so all ranks stay in step);
    # rank 0 alone writes the log, metrics, plot and checkpoints. An error on any rank
    # ends the whole job.
    rank, world, ddp_model = 0, 1, None
    if given.get("ddp"):
        import microtensor.distributed as dist
        rank, world = dist.init()
        cleanup.enter_context(dist.abort_on_error())
        if world == 1:
            import importlib.util
            why = ("mpi4py is not installed (pip install \"microtensor[mpi]\")"
                   if importlib.util.find_spec("mpi4py") is None
                   else "it was not started by an MPI launcher, or with -n 1")
            _cli.warn(prog, f"--ddp runs one process here: {why}; to train in 2 processes: "
                            f"mpiexec -n 2 {_cli.command(__file__, '--ddp', '...')}")
        if rank > 0:
            sys.stdout = open(os.devnull, "w")
    # --- end ddp

    # -------------------------------------------------------------------------
    # settings: defaults < checkpoint (when resuming) < command line
    out_dir = given.get("out_dir", DEFAULTS["out_dir"])
    last_path = os.path.join(out_dir, "ckpt_last.safetensors")
    best_path = os.path.join(out_dir, "ckpt_best.safetensors")
    checkpoint = None
    run = dict(DEFAULTS)

    def resume_remedy(missing):
        """What to do when ckpt_last cannot be resumed: ckpt_best is a file of its own."""
        other = chardata.other_checkpoint(missing)
        at = chardata.readable_iter(other) if other else None
        if at is not None:
            return (f". To go on from the best checkpoint, {other} (iteration {at}, a "
                    f"separate file), copy it over: cp {other} {last_path} and run again "
                    f"with --resume; or start again with --force")
        return f". No other checkpoint in {out_dir} can be read: start again with --force"
    try:
        if given.get("resume"):
            if not os.path.exists(last_path):
                if chardata.other_checkpoint(last_path):
                    fail(f"--resume: no checkpoint at {last_path}" + resume_remedy(last_path))
                fail(f"--resume: there is no checkpoint in {out_dir} (no {last_path}), so "
                     f"there is nothing to resume: run without --resume to start a run there")
            try:
                checkpoint = chardata.load_checkpoint(last_path)
            except chardata.DamagedCheckpoint as e:
                fail(f"{e}" + resume_remedy(last_path))
            saved = checkpoint[2]
            for key in MODEL_SHAPE_KEYS:
                if key in given and given[key] != saved["run"].get(key, DEFAULTS[key]):
                    fail(f"--{key} {given[key]} does not match the checkpoint's {key}="
                         f"{saved['run'].get(key, DEFAULTS[key])} ({last_path}); drop "
                         f"--{key} to resume, or use another --out_dir for a new model")
            run.update({k: v for k, v in saved["run"].items()
                        if k in DEFAULTS and k not in NOT_RESUMED_KEYS})
        elif given.get("init_from"):
            shaped = [k for k in PRETRAINED_KEYS if k in given]
            if shaped:
                fail(f"--{shaped[0]}: with --init_from the model is the checkpoint's, as its "
                     f"config.json says; drop --{shaped[0]}")
            run.update(FINETUNE_DEFAULTS)
        run.update(given)
    except CharDataError as e:
        fail(str(e))
    if run["data"] is not None:
        run["data"] = os.path.abspath(run["data"])  # --resume may run from elsewhere
    if run["min_lr"] is None:
        run["min_lr"] = run["lr"] / 10
    if run["lr_decay_iters"] is None:
        run["lr_decay_iters"] = run["max_iters"]
    for key in ("block_size", "batch_size", "grad_accum", "eval_interval", "eval_iters",
                "n_layer", "n_head", "n_embd"):
        if run[key] < 1:
            fail(f"--{key} must be at least 1, got {run[key]}")
    for key in ("max_iters", "warmup_iters", "sample_chars"):
        if run[key] < 0:
            fail(f"--{key} must be at least 0, got {run[key]}")
    if not 0.0 <= run["dropout"] < 1.0:
        fail(f"--dropout must be in [0, 1), got {run['dropout']}")
    _cli.check_heads(prog, "n_embd", run["n_embd"], run["n_head"])
    if run["min_lr"] > run["lr"]:
        fail(f"--min_lr {run['min_lr']:g} is above --lr {run['lr']:g}: the schedule decays "
             "from lr down to min_lr")
    if run["lr"] > 1:
        print(f"note: --lr {run['lr']:g} is far above the usual 1e-4 to 1e-2; if the loss "
              "becomes NaN or Inf the run stops and keeps its last good checkpoint",
              file=sys.stderr)

    # -------------------------------------------------------------------------
    # data: characters (or the pretrained checkpoint's BPE tokens) -> ids, 90% train / 10% val
    hf_dir = os.path.join(out_dir, "hf")   # --init_from: the best model, Hugging Face's format
    init_path = None
    if run["init_from"] and checkpoint is None:
        from models.pretrained import resolve_checkpoint
        try:
            init_path = resolve_checkpoint(run["init_from"])
        except (OSError, TypeError) as e:
            fail(f"--init_from: {e}")
    unit = "token" if run["init_from"] else "character"
    try:
        text = chardata.load_corpus(run["data"])
        data_name = run["data"] or "the default corpus (pydoc_data)"
        if run["init_from"]:   # the checkpoint's BPE (a resumed run's copy in out_dir/hf)
            tokenizer = chardata.BPETokenizerFiles(
                hf_dir if checkpoint is not None else
                init_path if os.path.isdir(init_path) else os.path.dirname(init_path))
        elif checkpoint is not None:  # the vocabulary is the checkpoint's
            tokenizer = chardata.CharTokenizer(checkpoint[2]["vocab"])
        else:
            tokenizer = chardata.CharTokenizer.from_text(text)
        ids = tokenizer.encode(text, what=f"data file {data_name}")
        train_data, val_data = chardata.train_val_split(ids, run["block_size"], data_name)
    except CharDataError as e:
        fail(str(e))
    if checkpoint and checkpoint[2].get("data_sha256") != chardata.text_fingerprint(text):
        print(f"note: {data_name} differs from the text this checkpoint was trained on",
              file=sys.stderr)

    # -------------------------------------------------------------------------
    # the output directory: writable, ours alone (a lock file naming this process, taken
    # over when its process is gone), and not holding an earlier run we would overwrite
    _cli.writable_dir(prog, out_dir, "--out_dir")
    try:
        if rank == 0:  # ddp: rank 0 alone owns out_dir
            cleanup.enter_context(_cli.OutDirLock(out_dir))
    except _cli.OutDirBusy as e:
        fail(f"--out_dir {out_dir} is {e}; wait for that run or choose another --out_dir")
    earlier = _cli.foreign_entries(out_dir) if rank == 0 else []  # ddp
    if earlier and not given.get("resume"):
        if not given.get("force"):
            fail(f"--out_dir {out_dir} already holds {', '.join(earlier[:4])}"
                 f"{' ...' if len(earlier) > 4 else ''}: continue that run with --resume, "
                 "start afresh there with --force, or choose another --out_dir")
        for name in OUTPUT_NAMES:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(out_dir, name))
        if os.path.isdir(hf_dir):
            import shutil
            shutil.rmtree(hf_dir)
    splits = {"train": train_data, "val": val_data}
    batch_rng = np.random.default_rng(run["seed"])  # the training batches

    def get_batch(split, rng):
        return chardata.get_batch(splits[split], run["block_size"], run["batch_size"], rng)

    # -------------------------------------------------------------------------
    # model and optimizer
    from models import GPT, GPTConfig
    import dataclasses
    model_options = dict(vocab_size=tokenizer.vocab_size, block_size=run["block_size"],
                         n_layer=run["n_layer"], n_head=run["n_head"], n_embd=run["n_embd"],
                         dropout=run["dropout"], bias=run["bias"], norm=run["norm"],
                         pos=run["pos"], mlp=run["mlp"], prenorm=run["prenorm"],
                         tie_weights=run["tie_weights"], d_ff=run["d_ff"])
    mt.manual_seed(run["seed"])
    if init_path is not None:
        # the pretrained model; --dropout, when given, replaces its config's three rates
        from models.pretrained import load_pretrained, CheckpointError
        p = given.get("dropout")
        overrides = {} if p is None else dict(dropout=p, attn_dropout=p, embd_dropout=p)
        try:
            model = load_pretrained(GPT, init_path, dtype=mt.float32, overrides=overrides)
        except (CheckpointError, OSError) as e:
            fail(f"--init_from {run['init_from']}: {e}")
        config = model.config
        # the run's record says what the model is (and --resume compares against it)
        run.update({k: getattr(config, k) for k in PRETRAINED_KEYS}, dropout=config.dropout)
        if rank == 0:  # the tokenizer beside the weights: out_dir/hf is complete on its own
            chardata.copy_tokenizer(tokenizer.folder, hf_dir)
    elif run["init_from"]:   # resuming a fine-tune: the shape is in the checkpoint
        config = GPTConfig(**checkpoint[2]["config"])
        model = GPT(config)
    else:
        try:
            config = GPTConfig(**model_options)
            model = GPT(config)
        except (ValueError, TypeError) as e:
            fail(f"invalid model settings: {e}")
    if run["block_size"] > config.block_size:
        fail(f"--block_size {run['block_size']} is longer than the model's "
             f"{config.block_size} positions")
    if tokenizer.vocab_size > config.vocab_size:
        fail(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only "
             f"{config.vocab_size}")

    # weight decay on matrices and embeddings, none on biases and norm gains (nanoGPT)
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    optimizer = mt.optim.AdamW(
        [{"params": decay, "weight_decay": run["weight_decay"]},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=run["lr"], betas=(run["beta1"], run["beta2"]))

    iter_num, best_val_loss = 0, float("inf")
    if checkpoint is not None:
        model_state, optimizer_state, saved = checkpoint
        try:
            model.load_state_dict(model_state)
            optimizer.load_state_dict(optimizer_state)
        except (KeyError, ValueError, RuntimeError) as e:
            fail(f"checkpoint {last_path} does not fit this model: {e}")
        iter_num, best_val_loss = saved["iter"], saved["best_val_loss"]
        mt.set_rng_state(saved["mt_rng_state"])
        batch_rng.bit_generator.state = saved["batch_rng_state"]
        if iter_num > run["max_iters"]:
            fail(f"the checkpoint is at iteration {iter_num}, beyond --max_iters "
                 f"{run['max_iters']}; give a larger --max_iters to continue")
    # --- ddp: rank 0's weights go to every rank; backward averages the gradients
    if given.get("ddp"):
        ddp_model = mt.nn.parallel.DistributedDataParallel(model)

    def train_forward(x, y, micro):
        """forward for training: under ddp, micro-batches before the last one of a step
        keep their gradients local (no_sync); the last backward averages the sum"""
        if ddp_model is None:
            return model(x, y)
        if micro < run["grad_accum"] - 1:
            with ddp_model.no_sync():
                return ddp_model(x, y)
        return ddp_model(x, y)
    # --- end ddp
    # --- the step, in three parts that mt.compile records once and replays: forward and
    # backward of a micro-batch, clipping, the update. Their results are read (.item())
    # between the parts, outside the compiled functions, to stop before a NaN spreads.
    def micro_step(x, y, micro):
        _, loss = train_forward(x, y, micro)
        (loss / run["grad_accum"]).backward()   # gradients add up over micro-batches
        return loss

    def clip_step():
        return mt.nn.utils.clip_grad_norm_(params, run["grad_clip"])

    def update_step():
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    compiled = given.get("compile", True) and ddp_model is None   # ddp: no_sync is Python state
    if compiled:
        micro_step, clip_step, update_step = (mt.compile(f) for f in (micro_step, clip_step,
                                                                       update_step))
    tokens_per_iter = run["batch_size"] * run["block_size"] * run["grad_accum"] * world
    n_params = model.num_parameters()
    print(f"{data_name}: {len(text):,} characters, vocabulary {tokenizer.vocab_size}, "
          f"{len(train_data):,} train / {len(val_data):,} val" + (" tokens" if unit == "token" else ""))
    print(f"model: {n_params:,} parameters "
          + (f"from {run['init_from']} " if run["init_from"] else "")
          + f"({config.n_layer} layers, {config.n_head} heads, n_embd {config.n_embd}, "
          f"{config.norm}, pos {config.pos}, mlp {config.mlp}); "
          f"{tokens_per_iter:,} tokens per step; "
          + (f"resuming at iteration {iter_num}" if checkpoint else f"{run['max_iters']} steps"))
    if checkpoint is not None and iter_num >= run["max_iters"]:
        print(f"note: this run already reached --max_iters {run['max_iters']}, so there is "
              f"nothing to train; to train further, raise it: --resume --max_iters "
              f"{2 * max(run['max_iters'], 1)} --out_dir {out_dir}")
    if compiled:
        print("step: mt.compile records it on the first two steps and replays it after "
              "(--no-compile: eager)")

    # -------------------------------------------------------------------------
    # evaluation, logging, checkpoints
    def estimate_loss():
        """Mean loss over eval_iters batches per split. The batches come from their own
        generator, the same at every evaluation: the curve compares like with like, and
        the training batches do not depend on how often we evaluate."""
        eval_rng = np.random.default_rng([run["seed"], 1])
        losses = {}
        model.eval()
        with mt.no_grad():
            for split in ("train", "val"):
                total = 0.0
                for _ in range(run["eval_iters"]):
                    if stop_requested:  # Ctrl-C: no need to finish a long evaluation
                        model.train()
                        return None
                    x, y = get_batch(split, eval_rng)
                    _, loss = model(x, y)
                    total += loss.item()
                losses[split] = total / run["eval_iters"]
        model.train()
        return losses

    def block_grad_norms():
        """|dL/dx| at each block's input for one batch of its own (the same batch at every
        evaluation, no dropout), through mt.inspect.GradientRecorder; the gradients it
        leaves are cleared, so the training run is the same with or without it."""
        from microtensor import inspect as mti
        from models import TransformerBlock
        x, y = get_batch("train", np.random.default_rng([run["seed"], 2]))
        recorder = mti.GradientRecorder(model, modules=TransformerBlock, residual=False)
        model.eval()
        try:
            with recorder:
                _, loss = model(x, y)
            loss.backward()
        finally:
            optimizer.zero_grad(set_to_none=True)
            recorder.remove_hooks()
            model.train()
        return [recorder[f"transformer.h.{i}"].input_norm for i in range(run["n_layer"])]

    grad_path = os.path.join(out_dir, "grad_stats.csv")
    grad_rows = []   # (iter, |dL/dx| at block 0, block 1, ...)
    if run["grad_stats"] and checkpoint is not None and os.path.exists(grad_path):
        with open(grad_path) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split(",")
                if len(fields) == run["n_layer"] + 1 and int(fields[0]) <= iter_num:
                    grad_rows.append((int(fields[0]),) + tuple(float(v) for v in fields[1:]))

    def write_grad_stats(tmp):
        with open(tmp, "w") as f:
            f.write("iter," + ",".join(f"block{i}" for i in range(run["n_layer"])) + "\n")
            f.writelines(",".join([str(r[0])] + [f"{v:.6g}" for v in r[1:]]) + "\n"
                         for r in grad_rows)

    metrics_path = os.path.join(out_dir, "metrics.csv")
    header = "iter,train_loss,val_loss,lr,tokens_per_sec\n"
    rows = []  # (iter, train_loss, val_loss, lr, tokens_per_sec)
    if checkpoint is not None and os.path.exists(metrics_path):
        # keep the history up to the checkpoint; later rows belong to a lost future
        with open(metrics_path) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split(",")
                if len(fields) == 5 and int(fields[0]) <= iter_num:
                    rows.append((int(fields[0]),) + tuple(float(v) for v in fields[1:]))
    def write_metrics(tmp):
        with open(tmp, "w") as f:
            f.write(header)
            f.writelines(f"{r[0]},{r[1]:.8g},{r[2]:.8g},{r[3]:.8g},{r[4]:.1f}\n" for r in rows)
    if rank == 0:  # ddp
        _cli.replace_with(metrics_path, write_metrics)

    def log_metrics(row):
        rows.append(row)
        if rank > 0:  # ddp: rank 0 alone writes
            return
        with open(metrics_path, "a") as f:
            f.write(f"{row[0]},{row[1]:.8g},{row[2]:.8g},{row[3]:.8g},{row[4]:.1f}\n")
        plot_losses()

    def plot_losses():
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        if grad_rows:
            fig, (ax, heat_ax) = plt.subplots(1, 2, figsize=(12, 4),
                                              gridspec_kw={"width_ratios": [7, 5]})
            plot_grad_stats(fig, heat_ax)
        else:
            fig, ax = plt.subplots(figsize=(7, 4))
        its = [r[0] for r in rows]
        ax.plot(its, [r[1] for r in rows], marker=".", label="train")
        ax.plot(its, [r[2] for r in rows], marker=".", label="val")
        ax.set_xlabel("iteration")
        ax.set_ylabel(f"loss (nats per {unit})")
        ax.set_title(f"{os.path.basename(data_name)}: {n_params:,}-parameter "
                     + (f"GPT from {run['init_from']}" if run["init_from"] else "char GPT"))
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        try:
            _cli.replace_with(os.path.join(out_dir, "loss.png"),
                              lambda tmp: fig.savefig(tmp, dpi=100))
        finally:
            plt.close(fig)

    def plot_grad_stats(fig, ax):
        """The heatmap: one row per block (block 0 at the bottom), one column per
        evaluation, colour the log10 of the gradient norm at the block's input."""
        values = np.array([r[1:] for r in grad_rows], dtype=np.float64).T   # (block, eval)
        logs = np.log10(np.maximum(values, 1e-30))
        image = ax.imshow(logs, aspect="auto", origin="lower", cmap="viridis",
                          interpolation="nearest")
        its = [r[0] for r in grad_rows]
        ticks = list(range(0, len(its), max(1, len(its) // 8)))
        ax.set_xticks(ticks, [str(its[k]) for k in ticks])
        ax.set_yticks(range(values.shape[0]), [f"block {i}" for i in range(values.shape[0])])
        ax.set_xlabel("iteration (evaluations)")
        ax.set_title("gradient norm reaching each block's input")
        fig.colorbar(image, ax=ax, label="log10 |dL/dx|")

    saved_iter = [iter_num if checkpoint is not None else None]  # of ckpt_last

    def stop_diverged(what):
        """A NaN or Inf: stop before anything is saved (exit status 1)."""
        progress.close()
        kept = (f"the last good checkpoint, {last_path} (iteration {saved_iter[0]}), is kept"
                if saved_iter[0] is not None else "no checkpoint was written")
        fail(f"{what} at iteration {iter_num}: training stopped and {kept}. Try a lower --lr "
             f"(this run: {run['lr']:g}) or --grad_clip", _cli.EXIT_ERROR)

    def save(path):
        if rank > 0:  # ddp: rank 0 alone saves
            return
        # NaN weights never overwrite a checkpoint
        bad = [name for name, p in model.named_parameters() if not np.isfinite(p.numpy()).all()]
        if bad:
            stop_diverged(f"the weights hold NaN or Inf ({bad[0]}"
                          f"{f' and {len(bad) - 1} more' if len(bad) > 1 else ''})")
        info = dict(
            run=run, config=dataclasses.asdict(config), vocab=tokenizer.chars,
            iter=iter_num, best_val_loss=best_val_loss,
            mt_rng_state=json.loads(mt.get_rng_state()),
            batch_rng_state=batch_rng.bit_generator.state,
            data_sha256=chardata.text_fingerprint(text))
        try:
            chardata.save_checkpoint(path, model, optimizer, info)
            if path == best_path and run["init_from"]:
                model.save_pretrained(hf_dir)   # what transformers and sample.py load
        except OSError as e:
            fail(f"cannot write checkpoint {path}: {e.strerror or e}", _cli.EXIT_ERROR)
        if path == last_path:
            saved_iter[0] = iter_num

    # Ctrl-C asks the loop to stop at the next step boundary, so the checkpoint it writes
    # is consistent (never half an optimizer step) and --resume continues exactly.
    # A second Ctrl-C interrupts at once.
    stop_requested = []
    stop_pending = []  # ddp: a rank's own Ctrl-C, until all ranks agree (loop top)

    def request_stop(signum, frame):
        (stop_pending if world > 1 else stop_requested).append(signum)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        tqdm.write("\ninterrupt: stopping after this step (Ctrl-C again to quit without saving)")

    try:
        previous_handler = signal.signal(signal.SIGINT, request_stop)
    except ValueError:  # not the main thread: plain KeyboardInterrupt behaviour
        previous_handler = None

    # -------------------------------------------------------------------------
    # the training loop
    model.train()
    progress = tqdm(total=run["max_iters"], initial=iter_num, unit="it", dynamic_ncols=True,
                    disable=None)  # None: no bar when stderr is not a terminal (logs)
    train_seconds, train_tokens = 0.0, 0   # since the last evaluation, for tokens/s
    run_start, start_iter = time.perf_counter(), iter_num   # this invocation's, for the ETA
    smoothed_tps = None
    try:
        while True:
            if world > 1 and dist.all_reduce(mt.tensor([float(len(stop_pending))])).item():
                stop_requested.append(signal.SIGINT)  # ddp: every rank stops at this step
            if stop_requested:
                save(last_path)
                progress.close()
                print(f"interrupted at iteration {iter_num}: saved {last_path}; "
                      f"continue with --resume --out_dir {out_dir}")
                return 130

            lr = get_lr(iter_num, run)
            for group in optimizer.param_groups:
                group["lr"] = lr

            eval_due = iter_num % run["eval_interval"] == 0 or iter_num == run["max_iters"]
            already_logged = bool(rows) and rows[-1][0] == iter_num  # resumed at an eval
            if eval_due and not already_logged:
                losses = estimate_loss()
                if losses is None:
                    continue
                if not all(math.isfinite(v) for v in losses.values()):
                    stop_diverged(f"the evaluation loss is train {losses['train']}, "
                                  f"val {losses['val']}")
                tps = train_tokens / train_seconds if train_seconds > 0 else 0.0
                train_seconds, train_tokens = 0.0, 0
                if run["grad_stats"]:
                    grad_rows.append((iter_num, *block_grad_norms()))
                    _cli.replace_with(grad_path, write_grad_stats)
                log_metrics((iter_num, losses["train"], losses["val"], lr, tps))
                elapsed, done = time.perf_counter() - run_start, iter_num - start_iter
                eta = (f", ETA {_cli.duration(elapsed / done * (run['max_iters'] - iter_num))}"
                       if done > 0 and iter_num < run["max_iters"] else "")
                progress.write(f"iter {iter_num}: train loss {losses['train']:.4f}, "
                               f"val loss {losses['val']:.4f}, lr {lr:.2e}"
                               + (f", {tps:,.0f} tok/s" if tps > 0 else "")  # once measured
                               + f", {_cli.duration(elapsed)} elapsed{eta}")
                improved = losses["val"] < best_val_loss
                best_val_loss = min(best_val_loss, losses["val"])
                save(last_path)
                if improved:   # a file of its own, written atomically: never a link to last
                    save(best_path)

            if iter_num >= run["max_iters"]:
                break

            t0 = time.perf_counter()
            if rank > 0:  # ddp: rank r's batches (and dropout) follow from (seed, rank, step)
                batch_rng = np.random.default_rng([run["seed"], rank, iter_num])
                mt.manual_seed(int(batch_rng.integers(2**62)))
            for micro in range(run["grad_accum"]):
                x, y = get_batch("train", batch_rng)
                loss_value = micro_step(x, y, micro).item()
                if not math.isfinite(loss_value):   # stop before the update spreads it
                    stop_diverged(f"the training loss is {loss_value}")
            if run["grad_clip"] > 0:
                grad_norm = clip_step().item()
                if not math.isfinite(grad_norm):
                    stop_diverged(f"the gradient norm is {grad_norm}")
            update_step()
            iter_num += 1

            dt = time.perf_counter() - t0
            train_seconds += dt
            train_tokens += tokens_per_iter
            tps = tokens_per_iter / dt
            smoothed_tps = tps if smoothed_tps is None else 0.9 * smoothed_tps + 0.1 * tps
            progress.set_postfix(loss=f"{loss_value:.4f}", lr=f"{lr:.2e}",
                                 tok_s=f"{smoothed_tps:,.0f}", refresh=False)
            progress.update(1)
    except KeyboardInterrupt:
        progress.close()
        print(f"interrupted at iteration {iter_num}; no checkpoint written "
              f"(the last one is {last_path})", file=sys.stderr)
        return 130
    finally:
        if previous_handler is not None:
            signal.signal(signal.SIGINT, previous_handler)
    progress.close()
    wrote = [n for n in OUTPUT_NAMES if os.path.exists(os.path.join(out_dir, n))]
    if run["init_from"] and os.path.isdir(hf_dir):
        wrote.append("hf/ (the best model in Hugging Face's format, with its tokenizer)")
        sample_from = ("--init_from", hf_dir)
    else:
        sample_from = ("--out_dir", out_dir)
    print(f"done: {iter_num} iterations, best val loss {best_val_loss:.4f}; wrote in "
          f"{out_dir}/: {', '.join(wrote)}")
    print("sample from it: " + _cli.command(os.path.join(os.path.dirname(__file__), "sample.py"),
                                            *sample_from))

    # -------------------------------------------------------------------------
    # a sample from the final model
    if run["sample_chars"] > 0 and rank == 0:  # ddp: one sample
        mt.manual_seed(run["seed"])
        start = "\n" if tokenizer.chars is None or "\n" in tokenizer.stoi else tokenizer.chars[0]
        start_ids = tokenizer.encode(start)
        idx = mt.from_numpy(start_ids[None, :])   # (1, 1), or a few BPE tokens
        model.eval()
        with mt.no_grad():
            out = model.generate(idx, run["sample_chars"], temperature=0.8, top_k=40)
        print(f"--- sample ({run['sample_chars']} {unit}s, temperature 0.8, top_k 40) ---")
        print(tokenizer.decode(out.numpy()[0, len(start_ids):]))
    return 0


if __name__ == "__main__":
    _cli.run(main)
