"""Every registered method is in the losslessness tests, or excluded there by name with a reason.

The three tests below read their methods from tests/methods.py, which reads the registry; these
checks fail if one of them goes back to a written-out list that misses a method, or if a method
needs a head the tests cannot make.
"""

from __future__ import annotations

import pytest

import tests.test_lossless as lossless
import tests.test_sampling_lossless as sampling_lossless
import tests.test_scheduler as scheduler
from specdecode.drafters.registry import METHOD_NAMES, REGISTRY
from tests.methods import EXCLUDED, HEAD_BUILDERS

# greedy identity, the sampling law (chi-square on the tiny vocabulary), batched equals solo
SHARED_TESTS = (
    lossless.test_greedy_identity,
    sampling_lossless.test_first_tokens_follow_the_exact_target_distribution,
    scheduler.test_concurrent_requests_equal_solo_greedy,
)


def parametrized_methods(test) -> set[str]:
    """The values of ``test``'s ``@pytest.mark.parametrize("method", ...)``."""
    return {value for mark in getattr(test, "pytestmark", [])
            if mark.name == "parametrize" and mark.args[0] == "method" for value in mark.args[1]}


@pytest.mark.parametrize("test", SHARED_TESTS, ids=lambda test: f"{test.__module__}.{test.__name__}")
def test_every_registered_method_is_in_the_losslessness_tests(test):
    speculative = set(METHOD_NAMES) - {"none"}
    missing = speculative - parametrized_methods(test) - set(EXCLUDED)
    assert not missing, (f"{test.__name__} leaves out {sorted(missing)}: parametrize it with "
                         "tests.methods.SPEC_METHODS, or name the method in tests.methods.EXCLUDED with why")


def test_every_head_a_method_needs_can_be_made_for_the_tests():
    for name, method in REGISTRY.items():
        if method.needs is not None and name not in EXCLUDED:
            assert method.needs in HEAD_BUILDERS, (f"method {name!r} needs {method.needs}: add a builder for a "
                                                   "tiny one to tests.methods.HEAD_BUILDERS, or exclude it")


def test_exclusions_name_registered_methods_with_a_reason():
    for name, why in EXCLUDED.items():
        assert name in REGISTRY and name != "none" and why.strip(), name
