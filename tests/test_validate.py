"""The one family of config value checks (scheduler/validate.py): one message style,
booleans are never numbers, NaN never passes, infinities only where allowed."""

import math
from fractions import Fraction

import numpy as np
import pytest

from proserve.scheduler import validate
from proserve.scheduler.request import ConfigError


@pytest.mark.parametrize("call, message", [
    (lambda: validate.positive("slide_batching", "gamma", 0), "slide_batching: gamma must be a number > 0, got 0"),
    (lambda: validate.non_negative("gain", "w_p", -1), "gain: w_p must be a number >= 0, got -1"),
    (lambda: validate.fraction("", "--stream-fraction", 1.5),
     "--stream-fraction must be a number in [0, 1], got 1.5"),
    (lambda: validate.number("go_routing", "alpha", 0.0, 0, 1, lo_open=True),
     "go_routing: alpha must be a number in (0, 1], got 0.0"),
    (lambda: validate.number("w", "kv_reserve", 1, 0, 1, hi_open=True),
     "w: kv_reserve must be a number in [0, 1), got 1"),
    (lambda: validate.number("w", "x", 5, hi=3), "w: x must be a number <= 3, got 5"),
    (lambda: validate.number("w", "ms", 4e6, 0.5, 3_600_000.0), "w: ms must be a number in [0.5, 3600000], got 4000000.0"),
    (lambda: validate.integer("vllm_fcfs", "max_num_seqs", 0),
     "vllm_fcfs: max_num_seqs must be an integer >= 1, got 0"),
    (lambda: validate.integer("w", "window", 1, 2), "w: window must be an integer >= 2, got 1"),
    (lambda: validate.integer("w", "pieces", 3, 1, 2), "w: pieces must be an integer in [1, 2], got 3"),
    (lambda: validate.one_of("w", "phi", "z", ("a", "c")), "w: phi must be one of a, c, got 'z'"),
    (lambda: validate.boolean("uniboost", "memguard", 1), "uniboost: memguard must be true or false, got 1"),
    (lambda: validate.text("priority class", "name", ""), "priority class: name must be a non-empty string, got ''"),
])
def test_one_message_style(call, message):
    with pytest.raises(ConfigError) as e:
        call()
    assert str(e.value) == message


@pytest.mark.parametrize("v", [True, False, float("nan"), float("inf"), -float("inf"), "1", None, [1], 10 ** 400])
def test_what_is_never_a_finite_number(v):
    with pytest.raises(ConfigError):
        validate.number("w", "x", v)


def test_infinity_passes_only_where_allowed():
    assert validate.positive("w", "x", math.inf, allow_inf=True) == math.inf
    with pytest.raises(ConfigError):
        validate.positive("w", "x", math.inf)
    with pytest.raises(ConfigError):   # NaN never passes
        validate.positive("w", "x", math.nan, allow_inf=True)


def test_values_come_back_in_their_canonical_type():
    assert type(validate.positive("w", "x", 2)) is float
    assert validate.number("w", "x", Fraction(1, 2)) == 0.5
    assert type(validate.number("w", "x", np.float32(0.25))) is float
    assert type(validate.integer("w", "n", np.int64(3))) is int
    assert validate.one_of("w", "k", "b", ("a", "b")) == "b"
    assert validate.boolean("w", "b", False) is False


@pytest.mark.parametrize("v", [2.0, 2.5, True, "2", None])
def test_an_integer_is_not_a_float_or_a_bool(v):
    with pytest.raises(ConfigError, match="n must be an integer >= 1"):
        validate.integer("w", "n", v)


def test_one_of_takes_only_the_choices_themselves():
    with pytest.raises(ConfigError, match=r"k must be one of a, b, got \['a'\]"):
        validate.one_of("w", "k", ["a"], ("a", "b"))


def test_the_caller_picks_the_exception_class():
    class BadRequest(ValueError):
        pass
    with pytest.raises(BadRequest, match="^vllm_xargs.weight must be a number > 0, got -1$"):
        validate.positive("", "vllm_xargs.weight", -1, error=BadRequest)
    with pytest.raises(BadRequest, match="^w: mu must be <= lam = 0.5, got 0.8$"):
        validate.fail("w", "mu", "<= lam = 0.5", 0.8, error=BadRequest)
