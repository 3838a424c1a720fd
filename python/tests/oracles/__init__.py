"""The oracles of the tests, kept out of the installed zopt package: the
float64 ``reference`` (the named rules of the numerics contract, docs/NUMERICS.md),
``interp`` (an interpreter of any description's text: the property
test's oracle, with its own parser) and ``ckptfmt`` (the checkpoint
format's checksums, to check the runtime's writer). The tests import them
as ``oracles.reference`` / ``oracles.interp`` (python/tests is on their
path)."""
