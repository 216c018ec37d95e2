"""What every example shares at its edges with the user.

- Bad input ends in one line, `prog: error: ...`, and exit status 2 (argparse's
  convention): `ArgumentParser` prints argparse's own errors that way, the `integer` and
  `number` types check ranges while the command line is parsed, and `fail()` reports
  what can only be checked later (two options that do not fit together, a data file).
- Ctrl-C never shows a traceback: `script(__name__)` at the top of an example covers the
  imports, `run(main)` at the bottom covers the rest; both print `prog: interrupted` and
  exit with status 130. A closed pipe (`| head`) ends the program quietly.
- Output: `writable_dir` checks a directory before minutes of work go into it,
  `OutDirLock` keeps two runs out of one directory, `foreign_entries` lists what an
  earlier run left there, and `temp_path` / `replace_with` give every file written
  atomically (temporary name, then rename) a name of its own process.

Only the standard library is imported here, so that Ctrl-C is covered from the first
line of an example on.
"""
import argparse
import math
import os
import shlex
import signal
import socket
import sys

EXIT_ERROR = 1           # the program ran and failed (e.g. the loss became NaN)
EXIT_USAGE = 2           # bad command line or input, argparse's status
EXIT_INTERRUPTED = 130   # 128 + SIGINT, what a shell reports for Ctrl-C


def prog_name():
    return os.path.basename(sys.argv[0]) or "python"


def minutes(seconds):
    """A run time in words: 38 -> '40 seconds', 89 -> '1.5 minutes', 1300 -> '22 minutes'."""
    if seconds < 55:
        return f"{max(10, round(seconds / 10) * 10)} seconds"
    if seconds < 600:
        value = round(seconds / 30) / 2
        return f"{value:g} minute{'s' if value != 1 else ''}"
    return f"{round(seconds / 60)} minutes"


def duration(seconds):
    """A duration on a clock: 5.2 -> '5s', 65 -> '1m05s', 3725 -> '1h02m'."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


# -----------------------------------------------------------------------------
# errors on one line

def command(script_path, *args):
    """The command line that runs an example as this process was run: this Python (by a
    path relative to the working directory when it lies below it, e.g. .venv/bin/python)
    and the script's path, so a printed command works when pasted."""
    def short(path):
        rel = os.path.relpath(path)
        return path if rel.startswith("..") else rel
    python = short(sys.executable) if os.path.isabs(sys.executable) else sys.executable
    parts = [python, short(os.path.abspath(script_path)), *args]
    return " ".join(shlex.quote(p) for p in parts)


def fail(prog, message, status=EXIT_USAGE):
    """Print `prog: error: message` on stderr and exit (SystemExit, so `finally` blocks
    run and an in-process caller can catch it)."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(status)


def warn(prog, message):
    """Print `prog: warning: message` on stderr, one line."""
    print(f"{prog}: warning: {message}", file=sys.stderr)


def cpus_available():
    """The CPUs this process may run on (its affinity mask), without importing numpy."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def resolve_threads(prog, threads):
    """The --threads value to use (0: the library's default), settled before microtensor
    is imported: a count above the CPUs this process may run on, from --threads or (when
    --threads is 0) from OMP_NUM_THREADS, is lowered to that count with a one-line warning
    (more threads than CPUs only wait for each other)."""
    cpus = cpus_available()
    if threads > cpus:
        warn(prog, f"--threads {threads} is more than the {cpus} CPUs this process may run "
                   f"on; using {cpus}")
        return cpus
    env = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if threads == 0 and env.isdigit() and int(env) > cpus:
        warn(prog, f"OMP_NUM_THREADS={env} is more than the {cpus} CPUs this process may run "
                   f"on; using {cpus}")
        os.environ["OMP_NUM_THREADS"] = str(cpus)
    return threads


class ArgumentParser(argparse.ArgumentParser):
    """argparse with its error on one line (no usage block above it)."""

    def error(self, message):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _range_text(lo, hi, lo_open, hi_open):
    lo_text, hi_text = (v if v is None or isinstance(v, int) else f"{v:g}" for v in (lo, hi))
    if lo is not None and hi is not None:
        return f"in {'(' if lo_open else '['}{lo_text}, {hi_text}{')' if hi_open else ']'}"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {lo_text}"
    if hi is not None:
        return f"{'<' if hi_open else '<='} {hi_text}"
    return "finite"


def number(lo=None, hi=None, lo_open=False, hi_open=False):
    """An argparse type: a finite float in the range (bounds closed unless *_open)."""
    def parse(text):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        ok = math.isfinite(value)
        ok = ok and (lo is None or (value > lo if lo_open else value >= lo))
        ok = ok and (hi is None or (value < hi if hi_open else value <= hi))
        if not ok:
            raise argparse.ArgumentTypeError(
                f"must be a number {_range_text(lo, hi, lo_open, hi_open)}, got {text}")
        return value
    parse.__name__ = "number"
    return parse


def integer(lo=None, hi=None):
    """An argparse type: an int in [lo, hi]."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            if hi is None:
                raise argparse.ArgumentTypeError(f"must be at least {lo}, got {value}")
            raise argparse.ArgumentTypeError(f"must be {_range_text(lo, hi, False, False)}, "
                                             f"got {value}")
        return value
    parse.__name__ = "integer"
    return parse


# the ranges that come up again and again
positive_int = integer(1)
nonnegative_int = integer(0)
seed_int = integer(0, 2**63 - 1)
positive_number = number(0, lo_open=True)
nonnegative_number = number(0)
probability = number(0, 1, hi_open=True)           # dropout: 0 <= p < 1
beta = number(0, 1, hi_open=True)                  # Adam's betas


def check_heads(prog, width_name, width, n_head):
    """Attention splits the width into n_head equal heads."""
    if width % n_head:
        fail(prog, f"--{width_name} must be a multiple of --n_head: {width_name}={width}, "
                   f"n_head={n_head} (try --n_head {largest_divisor(width, n_head)})")


def largest_divisor(width, at_most):
    return max(d for d in range(1, at_most + 1) if width % d == 0)


# -----------------------------------------------------------------------------
# Ctrl-C and closed pipes

def script(module_name):
    """Call first thing in an example as `_cli.script(__name__)`: when it runs as a
    script, a Ctrl-C that arrives before `run()` takes over (while numpy, matplotlib
    and microtensor are being imported) exits quietly too.

    NOTE: not by catching KeyboardInterrupt: raised inside an extension module's import
    (numpy's), it comes out as an ImportError with a traceback. During the imports there
    is nothing to save, so the signal handler ends the process on the spot."""
    if module_name != "__main__":
        return  # imported (by a test): leave the interpreter's behaviour alone

    def exit_now(signum, frame):
        _say_interrupted()
        os._exit(EXIT_INTERRUPTED)
    signal.signal(signal.SIGINT, exit_now)


def _say_interrupted():
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    print(f"{prog_name()}: interrupted", file=sys.stderr, flush=True)


def run(main):
    """sys.exit(main()), with Ctrl-C -> `prog: interrupted`, status 130, and a reader
    that went away (`python examples/sample.py | head -3`) -> a quiet end."""
    # from here on a Ctrl-C is a KeyboardInterrupt again, which main() may handle (the
    # training loops save a checkpoint first)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        status = main()
    except KeyboardInterrupt:
        _say_interrupted()
        status = EXIT_INTERRUPTED
    except BrokenPipeError:
        # NOTE: Python would complain again when it flushes stdout at exit; point
        # stdout at /dev/null first (the recipe of Python's signal documentation)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        status = EXIT_ERROR
    sys.exit(status)


# -----------------------------------------------------------------------------
# output files and directories

def temp_path(path):
    """A temporary name beside `path`, of this process only (two runs writing the same
    file never share one), keeping the extension: out/loss.png -> out/.loss.1234.tmp.png"""
    directory, name = os.path.split(path)
    stem, ext = os.path.splitext(name)
    return os.path.join(directory, f".{stem}.{os.getpid()}.tmp{ext}")


def replace_with(path, write):
    """write(tmp) to a temporary name of this process, then rename it to `path` in one
    step: a reader never sees half a file, and a crash leaves the old one."""
    tmp = temp_path(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise


def writable_dir(prog, path, option="--out"):
    """Create the directory `path` if needed and make sure a file can be written there;
    otherwise one line naming the problem."""
    if os.path.exists(path) and not os.path.isdir(path):
        fail(prog, f"{option} {path} is a file, not a directory")
    try:
        os.makedirs(path, exist_ok=True)
        probe = temp_path(os.path.join(path, "write_test"))
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        fail(prog, f"cannot write to {option} {path}: {e.strerror or e}")


def foreign_entries(out_dir):
    """What a directory holds besides hidden files (the lock, temporary files)."""
    try:
        return sorted(n for n in os.listdir(out_dir) if not n.startswith("."))
    except FileNotFoundError:
        return []


class OutDirBusy(Exception):
    """Another live process holds the lock of this directory."""


LOCK_NAME = ".lock"
_held = set()   # lock files this process holds (an in-process second run is refused too)


def _start_time(pid):
    """The process's start time in clock ticks since boot (Linux), to tell a live
    process from a new one that was given a dead one's pid; None elsewhere."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid, start_time):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True          # someone else's process: it exists
    return start_time is None or _start_time(pid) in (None, start_time)


class OutDirLock:
    """A lock file `out_dir/.lock` holding the owner's pid, host and start time.

    Taken with O_EXCL, so of two runs that start together exactly one gets it. A lock
    whose process is gone (killed, crashed) is stale and taken over; a lock from another
    host cannot be checked and counts as held."""

    def __init__(self, out_dir):
        self.path = os.path.join(out_dir, LOCK_NAME)
        self.held = False

    def _identity(self):
        return f"{os.getpid()} {socket.gethostname()} {_start_time(os.getpid())}\n"

    def _holder(self, path):
        """(pid, host, start_time) from a lock file, or None if it cannot be read."""
        try:
            with open(path) as f:
                fields = f.read().split()
            return int(fields[0]), fields[1], (None if fields[2] == "None" else fields[2])
        except (OSError, ValueError, IndexError):
            return None

    def acquire(self):
        """Take the lock or raise OutDirBusy (with the holder's pid in the message)."""
        me = self._identity()
        for _ in range(5):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder = self._holder(self.path)
                if holder is None:
                    raise OutDirBusy(f"{self.path} exists but cannot be read; delete it if no "
                                     "run is using this directory") from None
                pid, host, start = holder
                mine = pid == os.getpid() and host == socket.gethostname()
                if host != socket.gethostname():
                    raise OutDirBusy(f"in use by process {pid} on host {host} (lock file "
                                     f"{self.path}; delete it if that run is over)") from None
                if (mine and self.path in _held) or (not mine and _alive(pid, start)):
                    raise OutDirBusy(f"in use by process {pid} (lock file {self.path})") from None
                self._take_over_stale(holder)
                continue
            with os.fdopen(fd, "w") as f:
                f.write(me)
            self.held = True
            _held.add(self.path)
            return self
        raise OutDirBusy(f"could not take the lock {self.path}")

    def _take_over_stale(self, holder):
        """Move a dead process's lock aside under a name of ours (a rename is atomic: of
        two processes doing this, one moves it, the other finds nothing), then make sure
        it really was the dead one's and not a lock another process took meanwhile."""
        aside = temp_path(self.path + "-stale")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        if self._holder(aside) != holder:   # a live process's fresh lock: put it back
            try:
                os.link(aside, self.path)
            except OSError:
                pass
        os.remove(aside)

    def release(self):
        if not self.held:
            return
        self.held = False
        _held.discard(self.path)
        holder = self._holder(self.path)
        if holder is not None and holder[0] == os.getpid():
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()
