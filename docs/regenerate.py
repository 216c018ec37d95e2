"""Rebuild the numbers and pictures that the docs quote, from the code that makes them.

    python docs/regenerate.py                    # run every part (a few minutes), rewrite
    python docs/regenerate.py --only seq2seq     # one part (names: --help)
    python docs/regenerate.py --check --quick    # recompute the cheap parts, compare, write
                                                 # nothing; exit 1 on drift (a test runs it)
    python docs/regenerate.py --check            # recompute every part and compare
    python docs/regenerate.py --only tinyshakespeare --data tinyshakespeare.txt
                                                 # the long run (tens of minutes)
    python docs/regenerate.py --only tinyshakespeare --from_run out-shakespeare
                                                 # quote a finished run of that command
    python docs/regenerate.py --render           # only rewrite the docs from the record

What a part measures is kept in docs/generated.json. The docs hold the quoted text in
marked blocks, `<!-- generated:NAME -->...<!-- /generated -->` (inline, or on lines of
their own), which are rewritten from that record; so are the run-time constants of the
examples (`DEFAULT_RUN_SECONDS = ...`) that their --help quotes. --check recomputes and
compares within a tolerance (a different CPU rounds float32 differently) and also checks
that every block and constant says what the record says. Run times are recorded as CPU
seconds of one thread (the wall clock of an idle core), and never compared: they depend
on the machine.

The tinyshakespeare runs are recorded runs: their record is rewritten only when one of
them is run again (--data) or read from a finished run (--from_run). The PyTorch figures
next to them come from a separate recorded run and are kept as they are.
"""
import argparse
import csv
import json
import math
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
IMG = os.path.join(ROOT, "docs", "img")
RECORD = os.path.join(ROOT, "docs", "generated.json")
DOCS = ["README.md", "docs/TRAINING.md", "docs/RESIDUAL_FLOW.md", "docs/MODELS.md",
        "docs/FUSED_OPS.md", "docs/EXPLORE.md", "docs/ARCHITECTURE.md"]
BLOCK = re.compile(r"<!-- generated:([\w-]+) -->(.*?)<!-- /generated -->", re.S)
RTOL = 2e-3          # recomputed numbers against the record (a CPU's float32 rounding)
RTOL_TRAINED = 0.03  # after hundreds of training steps such differences have grown
RTOL_NOISY = 0.5     # values at float32's floor (a stack with no residuals): rounding noise


def minutes(seconds):
    """The wording the examples' --help uses for a run time."""
    sys.path.insert(0, EXAMPLES)
    try:
        import _cli
    finally:
        sys.path.remove(EXAMPLES)
    return _cli.minutes(seconds)


# -----------------------------------------------------------------------------
# running the examples

def run_example(script, *argv, cwd=None):
    """Run an example as a user does; -> (stdout, CPU seconds, wall seconds). A failure
    stops everything with the example's own output."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.time()
    result = subprocess.run([sys.executable, os.path.join(EXAMPLES, script), *argv],
                            capture_output=True, text=True, cwd=cwd)
    wall = time.time() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if result.returncode != 0:
        sys.exit(f"regenerate.py: {script} {' '.join(argv)} failed with status "
                 f"{result.returncode}:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    return result.stdout, round(cpu, 1), round(wall, 1)


def machine():
    """The load, the CPUs, the CPU model and the thread count an example runs at by
    default: float32 results (the last digits of a loss, a sampled text, an accuracy
    near 100%) depend on the CPU's vector code, so each figure says where it was taken."""
    m = dict(load_average=round(os.getloadavg()[0], 1), cpus=os.cpu_count())
    try:
        from microtensor.buildinfo import cpu_model
        from microtensor.threads import default_num_threads
    except ImportError:       # the examples' microtensor is not this process's: say less
        return m
    return dict(m, cpu=cpu_model(), threads=default_num_threads())


# A busy machine slows even the CPU time of a single thread (shared caches, a vCPU's
# stolen time): twice as slow at a load average of 12 on 2 cores. So a run time measured
# while the machine was busier than it has CPUs does not replace one measured at a lower
# load; it is recorded only when there is none.
TIMING = ("cpu_seconds", "wall_seconds", "quick_cpu_seconds", "machine")


def busier(new, old):
    """True when `new`'s run time should not replace `old`'s (see TIMING)."""
    if "machine" not in new:        # nothing timed (constants read from the sources)
        return False
    load, cpus = new["machine"]["load_average"], new["machine"]["cpus"]
    if not old or "cpu_seconds" not in old or load <= cpus:
        return False
    old_load = old.get("machine", {}).get("load_average")
    return old_load is None or load > old_load


def conditions(v):
    """How busy the machine was when the run time was taken, in words."""
    m = v.get("machine") or {}
    if m.get("note"):
        return m["note"]
    load = m.get("load_average")
    where = f"on the {m.get('cpus', 2)}-core development machine" + (
        f" ({m['cpu']})" if m.get("cpu") else "")
    if load is None:
        return where
    busy = load > m.get("cpus", 2)
    return (f"{where} at a load average of {load:g}"
            + (", a busy machine: less on an idle one" if busy else ""))


def threads_used(v):
    """'on one thread' (runs recorded before the examples took the library's default),
    else 'at the default N threads'."""
    n = (v.get("machine") or {}).get("threads")
    return "on one thread" if n in (None, 1) else f"at the default {n} threads"


def cpu_named(v):
    """' on <CPU model>' when the record names the CPU, else ''."""
    cpu = (v.get("machine") or {}).get("cpu")
    return f" on {cpu}" if cpu else ""


def sci(x):
    """1e-3, 7e-7, 4e-10: one significant digit, no padded exponent."""
    mantissa, exponent = f"{x:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def read_metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.csv")) as f:
        return [dict(iter=int(r["iter"]), train=float(r["train_loss"]), val=float(r["val_loss"]))
                for r in csv.DictReader(f)]


def chardata():
    sys.path.insert(0, EXAMPLES)
    try:
        import chardata
    finally:
        sys.path.remove(EXAMPLES)
    return chardata


def unigram_entropy(text):
    from collections import Counter
    counts = list(Counter(text).values())
    total = sum(counts)
    return -sum(c / total * math.log(c / total) for c in counts)


def train_char_run(argv, tmp, sample_seed=None):
    """train_char.py with argv into a fresh out_dir -> the numbers the docs quote."""
    out_dir = os.path.join(tmp, "out")
    stdout, cpu, wall = run_example("train_char.py", *argv, "--out_dir", out_dir)
    return describe_train_char_run(out_dir, stdout, cpu=cpu, wall=wall), out_dir


def describe_train_char_run(out_dir, stdout=None, cpu=None, wall=None):
    cd = chardata()
    _, _, info = cd.load_checkpoint(os.path.join(out_dir, "ckpt_last.safetensors"))
    run = info["run"]
    if stdout is None or "--- sample" not in stdout:
        # the run's final sample again: train_char.py seeds it with --seed, from a newline
        stdout, _, _ = run_example(
            "sample.py", "--ckpt", os.path.join(out_dir, "ckpt_last.safetensors"),
            "--seed", str(run["seed"]), "--temperature", "0.8", "--top_k", "40",
            "--max_new_tokens", str(run["sample_chars"] or 500))
        sample = stdout[:-1] if stdout.endswith("\n") else stdout
    else:
        sample = stdout.split("---\n", 1)[1].rstrip("\n")
    model = re.search(r"model: ([\d,]+) parameters", stdout or "")
    n_params = (int(model.group(1).replace(",", "")) if model
                else cd.build_model(info["config"]).num_parameters())
    data = run["data"]
    text = cd.load_corpus(data)
    return dict(
        data=None if data is None else os.path.basename(data), characters=len(text),
        vocab=len(info["vocab"]), unigram=unigram_entropy(text), parameters=n_params,
        settings={k: run[k] for k in ("n_layer", "n_head", "n_embd", "block_size",
                                       "batch_size", "max_iters", "lr", "norm", "pos", "mlp",
                                       "d_ff", "warmup_iters", "weight_decay", "beta2")},
        tokens_per_step=run["batch_size"] * run["block_size"] * run["grad_accum"],
        metrics=read_metrics(out_dir), best_val=info["best_val_loss"], sample=sample,
        cpu_seconds=cpu, wall_seconds=wall, machine=machine())


# -----------------------------------------------------------------------------
# The parts. measure(tmp, write) runs the example and returns what the record keeps
# (write: its pictures go to docs/img); quick(tmp, recorded) recomputes a cheap subset;
# compared(values) is what a check compares; render(values, record) -> {block: text};
# constants(values) -> {(file, NAME): int}.

class Part:
    name = ""
    cheap = False            # --check --quick recomputes it
    recorded = False         # run only when asked (--data / --from_run)
    keeps_record = True      # False: the files it writes are its own record
    loose = ()               # parts of a path whose numbers get RTOL_NOISY

    def recorded_values(self, record):
        return record.get(self.name)

    def quick(self, tmp, recorded):
        raise NotImplementedError

    def compared(self, values):
        return values

    def render(self, values, record):
        return {}

    def constants(self, values):
        return {}


class ResidualFlow(Part):
    """examples/residual_flow.py: the pictures in docs/img and the numbers quoted with
    them in docs/RESIDUAL_FLOW.md and the README."""
    name = "residual_flow"
    cheap = True
    # without residuals the positions' vectors collapse to float32's resolution (spread
    # ~3e-7): those numbers are mostly rounding, and differ from CPU to CPU
    loose = ("no_residual", "no residual")

    def measure(self, tmp, write):
        out = IMG if write else os.path.join(tmp, "img")
        facts_path = os.path.join(tmp, "facts.json")
        _, cpu, wall = run_example("residual_flow.py", "--out", out, "--json", facts_path)
        with open(facts_path) as f:
            facts = json.load(f)
        _, quick_cpu, _ = run_example("residual_flow.py", "--quick", "--out",
                                      os.path.join(tmp, "quick"))
        return dict(facts=facts, cpu_seconds=cpu, wall_seconds=wall,
                    quick_cpu_seconds=quick_cpu, machine=machine())

    def quick(self, tmp, recorded):
        """Experiments 1 and 2 at the recorded deepest stack only: each depth is built
        and seeded on its own, so the deepest one's numbers (the ones quoted) come out as
        in the full run. Experiment 3 (training, minutes) is left to the full check."""
        deepest = recorded["facts"]["depth"]["deepest"]
        facts_path = os.path.join(tmp, "facts.json")
        run_example("residual_flow.py", "--depths", str(deepest), "--skip", "training",
                    "--out", os.path.join(tmp, "img"), "--json", facts_path)
        with open(facts_path) as f:
            return dict(facts=json.load(f))

    def compared(self, values):
        facts = dict(values["facts"])
        facts["depth"] = {k: v for k, v in facts["depth"].items() if k != "depths"}
        return dict(facts=facts)

    def constants(self, values):
        return {("examples/residual_flow.py", "FULL_RUN_SECONDS"): round(values["cpu_seconds"]),
                ("examples/residual_flow.py", "QUICK_RUN_SECONDS"):
                    round(values["quick_cpu_seconds"])}

    def render(self, values, record):
        f = values["facts"]
        scalar, depth, train = f["scalar"], f["depth"], f["training"]
        pre, no_res, post, shallow_pre, shallow_post = train["labels"]
        final, escape = train["final"], train["escape"]
        deep, shallow = train["deep"], train["shallow"]

        def leaves(label, it="it"):
            step = escape[label]
            return f"never leaves {it}" if step is None else f"leaves {it} at step {step}"

        collapse = depth["collapse_block"]
        blocks = {}
        blocks["residual_flow_commands"] = (
            "```\n"
            "python examples/residual_flow.py            # tables on stdout, pictures in "
            f"out-residual_flow/ (about {minutes(values['cpu_seconds'])})\n"
            "python examples/residual_flow.py --quick    # smaller "
            f"(about {minutes(values['quick_cpu_seconds'])})\n"
            "python examples/residual_flow.py --out docs/img   # the pictures below "
            "(docs/regenerate.py runs this)\n"
            "python examples/graph.py                    # the graph pictures (DOT + PNG) in "
            "out-graph/\n"
            "```")
        blocks["residual_flow_summary"] = (
            f"The scalar stack shows it in its purest form ({scalar['depth']} layers of "
            f"`tanh(0.5x)`: {sci(scalar['plain'])} plain, {scalar['shortcut']:.2g} with the "
            f"shortcut). In a {depth['deepest']}-block Transformer at initialisation, with "
            "residuals every block's weights get about the same gradient (first/last "
            f"{depth['ratio_residual']:.2g}); without them the nearly uniform attention "
            "averages the positions block after block"
            + (f", until by block {collapse} every position carries the same vector"
               if collapse is not None else "")
            + f", and the first block's weights get {sci(depth['ratio_no_residual'])} of the "
            "last block's gradient. Where the norm sits matters less at initialisation "
            "(both placements start flat with GPT-2's small init) than in training: at "
            f"{deep} blocks the post-norm model sits on the plateau of \"predict character "
            + ("frequencies\" for the whole run, " if escape[post] is None else
               f"frequencies\" until step {escape[post]} of {train['train_iters']}, ")
            + f"where pre-norm {leaves(pre)}; at {shallow} blocks post-norm "
            f"{leaves(shallow_post)} and pre-norm {leaves(shallow_pre)}. Without residuals "
            f"the {deep}-block model {leaves(no_res, 'the plateau')}.")
        blocks["residual_flow_caption_2b"] = (
            "*2b. The same, pre-norm (`x + f(norm(x))`, GPT-2) against post-norm "
            "(`norm(x + f(x))`, 2017). Both flat at initialisation. Block 0 stands out in "
            "post-norm: its attention reads the raw embeddings (scale 0.02) with no norm in "
            f"front, so its gradients are {depth['post_block0_input']:.0f}x (input) and "
            f"{depth['post_block0_params']:.0f}x (weights) the median of the other blocks.*")
        blocks["residual_flow_caption_3"] = (
            f"*3. {train['train_iters']} AdamW steps (lr {sci(train['lr'])}, short warmup, batch "
            f"{train['batch_size']} x {train['block_size']} characters, the same batches for "
            "every run). The dotted line is the entropy of the character frequencies, "
            f"{train['unigram']:.2f} nats/char: a curve on it is a model that ignores its "
            "input. Final training losses (mean of the last "
            f"{max(1, train['train_iters'] // 10)} steps): {deep} blocks pre-norm "
            f"{final[pre]:.2f}, no residual {final[no_res]:.2f}, post-norm "
            f"{final[post]:.2f}; {shallow} blocks pre-norm {final[shallow_pre]:.2f}, "
            f"post-norm {final[shallow_post]:.2f}.*")
        table = depth["split_table"].splitlines()
        blocks["residual_flow_recorder_table"] = (
            "```\n" + "\n".join(table[:6] + ["..."]) + "\n```")
        blocks["readme_residual_flow"] = (
            f"without them the first of {depth['deepest']} blocks gets "
            f"{sci(depth['ratio_no_residual'])} of the weight gradient that the last one gets, "
            f"and at {deep} blocks post-norm "
            + (f"never leaves the loss plateau in {train['train_iters']} steps"
               if escape[post] is None else
               f"leaves the loss plateau at step {escape[post]}")
            + (f" where pre-norm leaves it at step {escape[pre]}" if escape[pre] is not None
               else ""))
        return blocks


class Graph(Part):
    """examples/graph.py: the graph pictures of docs/RESIDUAL_FLOW.md. No numbers; its
    record is the DOT text of the pictures in docs/img, which a check compares."""
    name = "graph"
    cheap = True
    keeps_record = False
    FILES = ("graph_expression.dot", "graph_block.dot", "graph_block_collapsed.dot")

    def measure(self, tmp, write):
        out = IMG if write else os.path.join(tmp, "graph")
        run_example("graph.py", "--out", out)
        if write:
            # the stills of the backward-pass animation (the GIF itself stays out of docs/)
            frames = os.path.join(tmp, "animation")
            run_example("graph.py", "--animate", "--out", frames)
            for name in ("backward_pass.png", "backward_depth.png"):
                shutil.copy(os.path.join(frames, name), os.path.join(IMG, name))
        return self.dot_texts(out)

    def quick(self, tmp, recorded):
        return self.measure(tmp, write=False)

    def recorded_values(self, record):
        return self.dot_texts(IMG)

    def dot_texts(self, folder):
        texts = {}
        for name in self.FILES:
            with open(os.path.join(folder, name)) as f:
                texts[name] = f.read()
        return texts


class Explore(Part):
    """examples/explore.py: the counts docs/EXPLORE.md quotes, read from the pages it
    writes (the data embedded in each page: what the page itself shows)."""
    name = "explore"
    cheap = True
    RESIDUAL12 = ("--n_layer", "12", "--n_embd", "64", "--block_size", "64",
                  "--batch_size", "8")

    @staticmethod
    def page_facts(path):
        with open(path, encoding="utf-8") as f:
            page = f.read()
        data = json.loads(re.search(r'<script type="application/json" id="explorer-data">'
                                    r'(.*?)</script>', page, re.S).group(1))
        return dict(nodes=len(data["nodes"]), ops=data["meta"]["ops"],
                    kb=round(len(page.encode()) / 1024))

    def measure(self, tmp, write, residual12=True):
        main_page = os.path.join(tmp, "main.html")
        run_example("explore.py", "--out", main_page, cwd=tmp)
        values = dict(main=self.page_facts(main_page))
        if residual12:
            deep = os.path.join(tmp, "residual12.html")
            run_example("explore.py", "--out", deep, *self.RESIDUAL12, cwd=tmp)
            values["residual12"] = self.page_facts(deep)
        return values

    def quick(self, tmp, recorded):
        return self.measure(tmp, write=False, residual12=False)

    def compared(self, values):
        # the counts are exact; a page's size moves with the digits of its numbers
        return {k: {"nodes": v["nodes"], "ops": v["ops"]} for k, v in values.items()}

    def render(self, v, record):
        main, deep = v["main"], v["residual12"]
        return {
            "explore_main_counts": (f"{main['nodes']} nodes ({main['ops']} ops) and weighs "
                                    f"about {round(main['kb'], -1):.0f} KB"),
            "explore_residual12_counts": (f"{deep['nodes']} nodes ({deep['ops']} ops), about "
                                          f"{round(deep['kb'], -2):.0f} KB"),
        }


class TrainCharDefault(Part):
    """examples/train_char.py with no arguments: docs/TRAINING.md's first section, the
    README's run time, the loss picture and the constant --help quotes."""
    name = "train_char"

    def measure(self, tmp, write):
        values, out_dir = train_char_run([], tmp)
        if write:
            shutil.copy(os.path.join(out_dir, "loss.png"),
                        os.path.join(IMG, "pydoc_default_loss.png"))
        return values

    def compared(self, values):
        return {k: values[k] for k in ("characters", "vocab", "parameters", "metrics")}

    def constants(self, values):
        # the wall clock: the run uses every core by default, so its CPU time is more
        return {("examples/train_char.py", "DEFAULT_RUN_SECONDS"): round(values["wall_seconds"])}

    def render(self, v, record):
        s, m = v["settings"], v["metrics"]
        return {
            "train_char_default_setup": (
                f"({v['characters']:,} characters, {v['vocab']} distinct ones), so nothing "
                "needs downloading. The model is small and the step is cheap: "
                f"{s['n_layer']} layers, {s['n_head']} heads, `n_embd` {s['n_embd']} "
                f"({v['parameters']:,} parameters), a context of {s['block_size']} characters, "
                f"{s['batch_size']} sequences per batch, {s['max_iters']:,} AdamW steps at a "
                f"peak learning rate of {sci(s['lr'])}."),
            "train_char_default_result": (
                "Start-up and the final sample included, the run takes "
                f"**{v['cpu_seconds']:.0f} s of CPU time** {threads_used(v)}"
                + (", which is the wall clock on an idle core"
                   if threads_used(v) == "on one thread" else "")
                + f" ({conditions(v)}: {v['wall_seconds']:.0f} s of wall "
                f"clock). The validation loss goes from {m[0]['val']:.2f} to "
                f"**{m[-1]['val']:.2f} nats per character** (the unigram entropy of the text is "
                f"{v['unigram']:.2f}):"),
            "train_char_default_sample": "```\n" + v["sample"] + "\n```",
            "readme_train_char_time": f"about {minutes(v['wall_seconds'])}{cpu_named(v)}",
        }


class Seq2Seq(Part):
    """examples/train_seq2seq.py with no arguments: its result in docs/MODELS.md and the
    README, and the constant --help quotes."""
    name = "seq2seq"

    def measure(self, tmp, write):
        path = os.path.join(tmp, "seq2seq.json")
        _, cpu, wall = run_example("train_seq2seq.py", "--json", path)
        with open(path) as f:
            values = json.load(f)
        values.update(cpu_seconds=cpu, wall_seconds=wall, machine=machine())
        return values

    def compared(self, values):
        return {k: values[k] for k in ("test_acc", "parameters", "n_test")}

    def constants(self, values):
        return {("examples/train_seq2seq.py", "DEFAULT_RUN_SECONDS"):
                round(values["wall_seconds"])}

    def render(self, v, record):
        longest = (f" ({v['longest_acc']:.1%} on the {v['n_longest']} of {v['max_len']} "
                   "digits)" if v.get("longest_acc") is not None else "")
        return {
            "models_seq2seq": (
                f"With the defaults ({v['parameters']:,} parameters, post-norm, 2 + 2 layers) "
                f"it stopped after {v['steps']:,} steps at **{v['test_acc']:.1%} exact match** "
                f"on {v['n_test']:,} held-out strings{longest}, in {v['cpu_seconds']:.0f} s "
                f"of CPU time ({conditions(v)})."),
            "readme_seq2seq": (f"{v['test_acc']:.1%} exact match{cpu_named(v)}, in about "
                               f"{minutes(v['wall_seconds'])}; the last digit depends on the "
                               "CPU"),
        }


class GradcheckLayers(Part):
    """examples/gradcheck_layers.py: the size of its table and its run time."""
    name = "gradcheck_layers"

    def measure(self, tmp, write):
        stdout, cpu, wall = run_example("gradcheck_layers.py")
        passed, total = map(int, re.search(r"(\d+)/(\d+) passed", stdout).groups())
        return dict(passed=passed, cases=total, cpu_seconds=cpu, wall_seconds=wall,
                    machine=machine())

    def compared(self, values):
        return {k: values[k] for k in ("passed", "cases")}

    def constants(self, values):
        return {("examples/gradcheck_layers.py", "DEFAULT_RUN_SECONDS"):
                round(values["cpu_seconds"])}

    def render(self, v, record):
        return {"models_gradcheck_layers": (
            f"{v['cases']} cases, {v['passed']} of them passing when last regenerated, in "
            f"about {minutes(v['cpu_seconds'])} of CPU time")}


class KernelConstants(Part):
    """Block sizes and thread thresholds that docs/FUSED_OPS.md quotes, read from the
    sources that define them (so the page cannot contradict the code)."""
    name = "kernel_constants"
    cheap = True
    PATTERNS = {  # name -> the line that defines it, somewhere in microtensor/
        "attention_block_causal": r"^_ATTENTION_BLOCK_CAUSAL = (\d+)",
        "attention_block": r"^_ATTENTION_BLOCK = (\d+)",
        "parallel_min_log2": r"^_PARALLEL_MIN = 1 << (\d+)",
        "parallel_min_memory_log2": r"^_PARALLEL_MIN_MEMORY_BOUND = 1 << (\d+)",
        "gemm_parallel_min_log2": r"^cdef double _PARALLEL_MIN_FLOPS = 1 << (\d+)",
        "small_matmul_log2": r"^cdef Py_ssize_t _SMALL_MATMUL = 1 << (\d+)",
    }

    def measure(self, tmp, write):
        sources = []
        for folder, _, files in os.walk(os.path.join(ROOT, "microtensor")):
            for name in sorted(files):
                if name.endswith((".py", ".pyx", ".pxi", ".pxd")):
                    with open(os.path.join(folder, name)) as f:
                        sources.append(f.read())
        values = {}
        for name, pattern in self.PATTERNS.items():
            found = [m for text in sources for m in re.findall(pattern, text, re.M)]
            if len(found) != 1:
                sys.exit(f"regenerate.py: microtensor/ has {len(found)} lines matching "
                         f"{pattern!r}, not one; update KernelConstants.PATTERNS")
            values[name] = int(found[0])
        return values

    def quick(self, tmp, recorded):
        return self.measure(tmp, write=False)

    def render(self, v, record):
        return {
            "attention_blocks": (f"{v['attention_block_causal']} rows under `is_causal`, "
                                 f"{v['attention_block']} without"),
            "kernel_thresholds": (
                "Memory-bound kernels (norms, embedding, dropout) are given threads from "
                f"2^{v['parallel_min_memory_log2']} elements, the others from "
                f"2^{v['parallel_min_log2']}, and each kernel keeps one thread below its own "
                "measured threshold besides (`threads_for` in `kernels/_common.pxd`, the constant "
                "beside the kernel); a gemm of `_blas` splits its output rows over the threads "
                f"from 2^{v['gemm_parallel_min_log2']} multiply-adds; `mt.matmul` hands "
                f"products below 2^{v['small_matmul_log2']} multiply-adds to numpy."),
        }


SHAKESPEARE_ARGS = ["--n_layer", "4", "--n_head", "4", "--n_embd", "128", "--block_size", "64",
                    "--batch_size", "12", "--max_iters", "2000", "--lr", "1e-3", "--dropout",
                    "0.0", "--warmup_iters", "100", "--weight_decay", "0.1", "--grad_clip",
                    "1.0", "--beta2", "0.99", "--eval_interval", "250", "--eval_iters", "200"]


class TinyShakespeare(Part):
    """nanoGPT's CPU configuration on tinyshakespeare (docs/TRAINING.md, the README): a
    recorded run, tens of minutes."""
    name = "tinyshakespeare"
    recorded = True
    extra = []
    out_dir = "out-shakespeare"
    picture = "tinyshakespeare_loss.png"

    def command(self):
        args = SHAKESPEARE_ARGS + self.extra
        lines = ["python examples/train_char.py --data tinyshakespeare.txt --out_dir "
                 + self.out_dir]
        lines += ["    " + " ".join(args[i:i + 8]) for i in range(0, len(args), 8)]
        return " \\\n".join(lines)

    def measure(self, tmp, write, data=None, from_run=None):
        if from_run:
            values, out_dir = describe_train_char_run(from_run), from_run
        else:
            values, out_dir = train_char_run(["--data", data] + SHAKESPEARE_ARGS + self.extra,
                                             tmp)
        values["command"] = self.command()
        if write:
            shutil.copy(os.path.join(out_dir, "loss.png"), os.path.join(IMG, self.picture))
        return values

    def compared(self, values):
        return {"metrics": values["metrics"]}

    @staticmethod
    def table(metrics, first=0):
        rows = [m for m in metrics if m["iter"] % 500 == 0 and m["iter"] >= first]
        return ("| iter | train loss | val loss |\n|-----:|-----------:|---------:|\n"
                + "\n".join(f"| {m['iter']:>4} | {m['train']:.3f} | "
                            + (f"**{m['val']:.3f}** |" if m is rows[-1] else f"{m['val']:.3f} |")
                            for m in rows))

    def render(self, v, record):
        torch_ref = v.get("pytorch_reference")
        final = v["metrics"][-1]["val"]
        return {
            "tinyshakespeare_command": "```\n" + v["command"] + "\n```",
            "tinyshakespeare_table": self.table(v["metrics"]),
            "tinyshakespeare_result": (
                f"{v['parameters']:,} parameters, {v['tokens_per_step']} tokens per step. "
                f"**Final validation loss {final:.3f}**"
                + ("" if not torch_ref else
                   ". A PyTorch implementation of the same model, trained with the same "
                   "settings, batches and evaluation batches (only the initial weights "
                   "differ; a separate recorded run, which `docs/regenerate.py` does not "
                   "redo), gave validation losses of "
                   + ", ".join(f"{x:.3f}" for x in torch_ref[:-1])
                   + f" and {torch_ref[-1]:.3f} at steps 500, 1000, 1500 and 2000: the two "
                   "engines follow the same curve.")),
            "tinyshakespeare_sample": "```\n" + v["sample"].strip("\n") + "\n```",
            "readme_tinyshakespeare": f"**{final:.3f}**" + (
                f" (PyTorch with the same model and batches, in a separate recorded run: "
                f"{torch_ref[-1]:.3f})" if torch_ref else ""),
            "tinyshakespeare_timing": timing(record),
        }


class TinyShakespeareModern(TinyShakespeare):
    """The same with RMSNorm, rotary positions and SwiGLU."""
    name = "tinyshakespeare_modern"
    extra = ["--norm", "rmsnorm", "--pos", "rope", "--mlp", "swiglu"]
    out_dir = "out-shakespeare-modern"
    picture = "tinyshakespeare_modern_loss.png"

    def render(self, v, record):
        blocks = {
            "tinyshakespeare_modern_table": self.table(v["metrics"], first=500),
            "tinyshakespeare_modern_sample": "```\n" + v["sample"].strip("\n") + "\n```",
            "readme_tinyshakespeare_modern": f"**{v['best_val']:.3f}**",
            "tinyshakespeare_timing": timing(record),
        }
        base = record.get("tinyshakespeare")
        if base:
            fewer = 1 - v["parameters"] / base["parameters"]
            blocks["tinyshakespeare_modern_params"] = (
                f"**{v['parameters']:,} parameters, {abs(fewer):.1%} "
                f"{'fewer' if fewer >= 0 else 'more'}**")
            base_final = base["metrics"][-1]["val"]
            below = [m["iter"] for m in v["metrics"] if m["val"] < base_final]
            blocks["tinyshakespeare_modern_result"] = (
                f"**Best validation loss {v['best_val']:.3f}**, "
                f"{base_final - v['best_val']:.2f} nats below the baseline with the same steps "
                "and about the same parameters"
                + (f"; by step {below[0]:,} it is already below the baseline's final loss"
                   if below else "") + ".")
        return blocks


def timing(record):
    """How long the two recorded runs took, from what their records kept."""
    runs = [(name, record[key]) for name, key in (("baseline", "tinyshakespeare"),
                                                  ("modern variant", "tinyshakespeare_modern"))
            if key in record]
    known = [(name, r) for name, r in runs if r.get("wall_seconds")]
    if not known:
        return "How long the runs took was not recorded."
    return ("On the shared 2-core machine, with other jobs running, one thread each: "
            + "; ".join(f"the {name} took {r['wall_seconds'] / 60:.0f} minutes"
                        + (f" ({r['cpu_seconds'] / 60:.0f} minutes of CPU time)"
                           if r.get("cpu_seconds") else "") for name, r in known)
            + "." + ("" if len(known) == len(runs) else " The other run's time was not kept."))


class LayerMap(Part):
    """The map of docs/ARCHITECTURE.md: the layers, bottom first, as tests/test_layering.py
    places them (its LAYERS), each with the layers below it that its imports reach, read
    from the code the same way the test reads it; and the index of docs/ (each doc's
    title). A new layer, a new import between layers or a new doc changes the map."""
    name = "layers"
    cheap = True

    @staticmethod
    def layering():
        import importlib.util
        path = os.path.join(ROOT, "tests", "test_layering.py")
        spec = importlib.util.spec_from_file_location("_test_layering", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    def measure(self, tmp, write):
        L = self.layering()
        reaches = {name: set() for name in L.LAYER_NAMES}
        for source, target, _, _ in L.arrows():
            a, b = L.layer(source), L.layer(target)
            if a != b:
                reaches[L.LAYER_NAMES[a]].add(L.LAYER_NAMES[b])
        layers = [[name, what, sorted(reaches[name], key=L.LAYER.get, reverse=True)]
                  for name, what in L.LAYERS]
        docs = []
        for doc in sorted(os.listdir(os.path.join(ROOT, "docs"))):
            if doc.endswith(".md"):
                with open(os.path.join(ROOT, "docs", doc)) as f:
                    title = next((line[2:].strip() for line in f if line.startswith("# ")), doc)
                docs.append([doc, title])
        return {"layers": layers, "docs": docs}

    def quick(self, tmp, recorded):
        return self.measure(tmp, write=False)

    @staticmethod
    def where(name):
        return {"face": "microtensor/*.py", "models": "models/",
                "examples": "examples/"}.get(name, f"microtensor/{name}/")

    def render(self, v, record):
        layers = v["layers"][::-1]                      # top first, as a stack is drawn
        width = max(len(name) for name, _, _ in layers) + 2
        folder = max(len(self.where(name)) for name, _, _ in layers) + 1
        lines = ["┌" + "─" * width + "┐"]
        for i, (name, _, reaches) in enumerate(layers):
            lines.append(f"│{name.center(width)}│  {self.where(name):<{folder}}"
                         + ("imports " + ", ".join(reaches) if reaches else "imports no other layer"))
            lines.append(("├" if i < len(layers) - 1 else "└") + "─" * width
                         + ("┤" if i < len(layers) - 1 else "┘"))
        lines.append(" " * (width // 2 - 2) + "every import points down this stack "
                     "(tests/test_layering.py)")
        picture = "```text\n" + "\n".join(lines) + "\n```"
        table = ("| layer | folder | what it holds |\n|---|---|---|\n"
                 + "\n".join(f"| {name} | `{self.where(name)}` | {what} |"
                              for name, what, _ in layers))
        index = "\n".join(f"- [{doc}]({doc}): {title}" for doc, title in v["docs"])
        # the same index for the README, whose links start one folder up
        readme_index = "\n".join(f"- [{doc}](docs/{doc}): {title}" for doc, title in v["docs"])
        return {"layer_map": picture, "layer_table": table, "docs_index": index,
                "readme_docs_index": readme_index}


PARTS = [KernelConstants(), LayerMap(), ResidualFlow(), Graph(), Explore(), TrainCharDefault(),
         Seq2Seq(),
         GradcheckLayers(), TinyShakespeare(), TinyShakespeareModern()]


# -----------------------------------------------------------------------------
# the record, the blocks, the constants

def load_record():
    if not os.path.exists(RECORD):
        return {}
    with open(RECORD) as f:
        return json.load(f)


def save_record(record):
    tmp = RECORD + f".{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, RECORD)


def rendered_blocks(record):
    blocks = {}
    for part in PARTS:
        if part.keeps_record and part.name in record:
            blocks.update(part.render(record[part.name], record))
    return blocks


def fill(text, blocks, where, problems):
    """The text with every block's content replaced by blocks[name]; an unknown name is a
    problem. A block whose markers sit on lines of their own keeps them there."""
    def replace(match):
        name, old = match.group(1), match.group(2)
        if name not in blocks:
            problems.append(f"{where}: block '{name}' is not made by any part (or its part "
                            "has no record yet)")
            return match.group(0)
        new = blocks[name]
        if old.startswith("\n"):
            new = "\n" + new + "\n"
        return f"<!-- generated:{name} -->{new}<!-- /generated -->"
    return BLOCK.sub(replace, text)


def constant_pattern(name):
    return re.compile(rf"^{name} = (\d+)$", re.M)


def all_constants(record):
    wanted = {}
    for part in PARTS:
        if part.name in record:
            wanted.update(part.constants(record[part.name]))
    return wanted


def write_docs(record):
    problems = []
    blocks = rendered_blocks(record)
    used = set()
    for doc in DOCS:
        path = os.path.join(ROOT, doc)
        with open(path) as f:
            text = f.read()
        used.update(name for name, _ in BLOCK.findall(text))
        new = fill(text, blocks, doc, problems)
        if new != text:
            write_text(path, new)
            print(f"rewrote {doc}")
    for (file, name), value in all_constants(record).items():
        path = os.path.join(ROOT, file)
        with open(path) as f:
            text = f.read()
        new, n = constant_pattern(name).subn(f"{name} = {value}", text)
        if n != 1:
            problems.append(f"{file}: no line '{name} = <int>'")
        elif new != text:
            write_text(path, new)
            print(f"rewrote {file}: {name} = {value}")
    problems += [f"no doc has the block '{name}'" for name in sorted(set(blocks) - used)]
    return problems


def write_text(path, text):
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def check_docs(record):
    """Every block and constant says what the record says."""
    problems = []
    blocks = rendered_blocks(record)
    used = set()
    for doc in DOCS:
        with open(os.path.join(ROOT, doc)) as f:
            text = f.read()
        used.update(m[0] for m in BLOCK.findall(text))
        if fill(text, blocks, doc, problems) != text:
            stale = [m[0] for m in BLOCK.findall(text)
                     if m[0] in blocks and m[1].strip("\n") != blocks[m[0]]]
            problems.append(f"{doc}: blocks {', '.join(stale)} differ from docs/generated.json "
                            "(run python docs/regenerate.py, or put the record right)")
    problems += [f"no doc has the block '{name}'" for name in sorted(set(blocks) - used)]
    for (file, name), value in all_constants(record).items():
        with open(os.path.join(ROOT, file)) as f:
            found = constant_pattern(name).findall(f.read())
        if found != [str(value)]:
            problems.append(f"{file}: {name} = {found[0] if found else '?'}, the record says "
                            f"{value}")
    return problems


def differences(new, old, rtol, path="", loose=()):
    """Where two records disagree: numbers beyond rtol (RTOL_NOISY where the path holds
    one of `loose`), anything else not equal. In text, the numbers are compared as
    numbers and the rest as text."""
    if isinstance(new, dict) and isinstance(old, dict):
        out = []
        for key in sorted(set(new) | set(old)):
            if key not in new or key not in old:
                out.append(f"{path}/{key}: only in the {'recomputed' if key in new else 'recorded'}")
            else:
                out += differences(new[key], old[key], rtol, f"{path}/{key}", loose)
        return out
    if isinstance(new, list) and isinstance(old, list):
        if len(new) != len(old):
            return [f"{path}: {len(new)} items, the record has {len(old)}"]
        return [d for i, (a, b) in enumerate(zip(new, old))
                for d in differences(a, b, rtol, f"{path}/{i}", loose)]
    if isinstance(new, str) and isinstance(old, str):
        number = r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?"
        if re.sub(number, "#", new) != re.sub(number, "#", old):
            return [f"{path}: the text differs"]
        return differences([float(x) for x in re.findall(number, new)],
                           [float(x) for x in re.findall(number, old)], rtol, path, loose)
    if any(part in path for part in loose):
        rtol = max(rtol, RTOL_NOISY)
    numbers = (int, float)
    if isinstance(new, numbers) and isinstance(old, numbers) and not isinstance(new, bool):
        if math.isclose(new, old, rel_tol=rtol, abs_tol=0.0) or (
                isinstance(new, int) and isinstance(old, int) and abs(new - old) <= rtol * abs(old)):
            return []
        return [f"{path}: {new!r} now, {old!r} in the record"]
    return [] if new == old else [f"{path}: {new!r} now, {old!r} in the record"]


# -----------------------------------------------------------------------------

def main(argv=None):
    names = [p.name for p in PARTS]
    parser = argparse.ArgumentParser(
        prog="regenerate.py", description=__doc__.split("\n\n")[0],
        epilog="parts: " + ", ".join(names))
    parser.add_argument("--only", nargs="+", choices=names, metavar="PART",
                        help="these parts only (default: every part except the recorded "
                             "tinyshakespeare runs)")
    parser.add_argument("--check", action="store_true",
                        help="recompute and compare with docs/generated.json and the docs; "
                             "write nothing; exit status 1 on a difference")
    parser.add_argument("--quick", action="store_true",
                        help="with --check: recompute only the cheap parts (under a minute); "
                             "the docs are still checked against the whole record")
    parser.add_argument("--render", action="store_true",
                        help="run nothing: rewrite the docs' blocks and the examples' "
                             "constants from docs/generated.json as it is")
    parser.add_argument("--data", help="tinyshakespeare.txt, to rerun a tinyshakespeare part")
    parser.add_argument("--from_run", metavar="OUT_DIR",
                        help="the --out_dir of a finished tinyshakespeare run of the "
                             "documented command: quote it instead of rerunning")
    args = parser.parse_args(argv)
    if args.quick and not args.check:
        parser.error("--quick goes with --check")
    if args.render:
        if args.check or args.only or args.data or args.from_run:
            parser.error("--render runs nothing: it takes no other option")
        problems = write_docs(load_record())
        for problem in problems:
            print(f"regenerate.py: {problem}", file=sys.stderr)
        return 1 if problems else 0
    if args.data and args.from_run:
        parser.error("give --data or --from_run, not both")
    selected = [p for p in PARTS if (p.name in args.only if args.only else not p.recorded)]
    if args.check and args.quick:
        selected = [p for p in selected if p.cheap]
    for part in selected:
        if part.recorded and not (args.data or args.from_run):
            parser.error(f"{part.name} is a recorded run: give --data FILE to rerun it or "
                         "--from_run OUT_DIR to quote a finished run")

    record = load_record()
    problems = []
    with tempfile.TemporaryDirectory(prefix="regenerate-") as tmp:
        for part in selected:
            part_tmp = os.path.join(tmp, part.name)
            os.makedirs(part_tmp)
            print(f"== {part.name}", flush=True)
            if args.check:
                old = part.recorded_values(record)
                if old is None:
                    problems.append(f"{part.name}: no record yet (run python "
                                    f"docs/regenerate.py --only {part.name})")
                    continue
                if args.quick:
                    new = part.compared(part.quick(part_tmp, old))
                    old = restrict(part.compared(old), new)
                else:
                    kwargs = (dict(data=args.data, from_run=args.from_run)
                              if part.recorded else {})
                    new = part.compared(part.measure(part_tmp, write=False, **kwargs))
                    old = part.compared(old)
                rtol = RTOL if args.quick else RTOL_TRAINED
                problems += [f"{part.name}{d}" for d in differences(new, old, rtol,
                                                                     loose=part.loose)]
            else:
                kwargs = dict(data=args.data, from_run=args.from_run) if part.recorded else {}
                values = part.measure(part_tmp, write=True, **kwargs)
                if part.keeps_record and busier(values, record.get(part.name)):
                    print(f"   the machine is busy (load average "
                          f"{values['machine']['load_average']:g}): the run time keeps its "
                          "earlier measurement", flush=True)
                    values.update({k: record[part.name][k] for k in TIMING
                                   if k in record[part.name]})
                if part.keeps_record:
                    kept = record.get(part.name, {}).get("pytorch_reference")
                    if kept is not None:    # a separate recorded run's numbers
                        values["pytorch_reference"] = kept
                    record[part.name] = values
                    save_record(record)
    problems += check_docs(record) if args.check else write_docs(record)
    for problem in problems:
        print(f"regenerate.py: {problem}", file=sys.stderr)
    if not problems:
        print("the docs match the code" if args.check else "done")
    return 1 if problems else 0


def restrict(old, new):
    """old with only the keys new has, recursively (a quick check recomputes part)."""
    if isinstance(old, dict) and isinstance(new, dict):
        return {k: restrict(v, new[k]) for k, v in old.items() if k in new}
    return old


if __name__ == "__main__":
    sys.exit(main())
