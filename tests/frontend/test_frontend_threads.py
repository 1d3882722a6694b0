"""Patterns and rules compile on first use; threads that first use one at once must not see
each other's compilation as a recursion, and get one definition."""

import threading
from concurrent.futures import ThreadPoolExecutor

import pypm_jax as pm
from pypm_jax.lang import frontend as _frontend


@pm.op
def ThreadsF(x):
    return 1


def test_a_pattern_compiling_in_one_thread_is_not_a_recursion_in_another(monkeypatch):
    @pm.pattern
    def ThreadsP(x):
        return ThreadsF(x)

    started, asked = threading.Event(), threading.Event()
    compile_ = _frontend.PatternFunction._compile

    def slow_compile(self):
        started.set()
        asked.wait(5)  # until the other thread has asked for the definition
        threading.Event().wait(0.2)  # and has had time to look at the compiling stack
        return compile_(self)

    monkeypatch.setattr(_frontend.PatternFunction, "_compile", slow_compile)

    def second():
        started.wait(5)
        asked.set()
        return ThreadsP.definition

    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(lambda: ThreadsP.definition)
        other = pool.submit(second)
        assert first.result() is other.result()


def test_eight_threads_first_use_a_rule_at_once():
    @pm.pattern
    def ThreadsQ(x):
        return ThreadsF(ThreadsF(x))

    @pm.rule(ThreadsQ)
    def threads_rule(x):
        return ThreadsF(x)

    barrier = threading.Barrier(8)

    def use(_):
        barrier.wait()
        return threads_rule.definition

    with ThreadPoolExecutor(8) as pool:
        defs = list(pool.map(use, range(8)))
    assert all(d is defs[0] for d in defs)
    x = pm.leaf("x", shape=(2,), dtype="f32")
    assert pm.match(ThreadsQ, ThreadsF(ThreadsF(x)))["x"] is x
