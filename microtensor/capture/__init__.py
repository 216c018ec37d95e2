"""Capture and replay: `mt.compile(fn)` records the ops of a function's call once and
replays them after (compiled.py: the front end, its keys and checks; recorder.py: how a
call is recorded; plan.py: the recorded calls, replayed and printed)."""
from microtensor.capture.compiled import compile, CompiledFunction
from microtensor.capture.recorder import recorded_call, register_guard
from microtensor.capture.plan import Plan

__all__ = ["compile", "CompiledFunction", "Plan", "recorded_call", "register_guard"]
