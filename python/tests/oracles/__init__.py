"""The float64 oracles of the tests, kept out of the installed zopt package:
``reference`` (the named rules of the numerics contract, docs/NUMERICS.md)
and ``interp`` (an interpreter of any description's text: the property
test's oracle, with its own parser). The tests import them as
``oracles.reference`` / ``oracles.interp`` (python/tests is on their path)."""
